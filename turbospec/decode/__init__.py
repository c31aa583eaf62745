"""Decoding: prompt text in and completion text out (``text``), one verify step on the target
(``step``), the generation loop and its statistics (``loop``) and the ``Engine`` facade."""
