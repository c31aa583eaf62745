"""Limits shared by the ops and everything that sizes buffers for them."""

# The most nodes (root + drafts) one verify step's tree may have: a tree mask row is one int64.
MAX_TREE_NODES = 64
