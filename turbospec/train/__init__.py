"""``turbospec train``: self-distillation data from the target (``data``), the losses (``objectives``),
the run's settings (``config``) and the training pipeline (``trainer``)."""
