"""The control plane: every scheduling decision, no torch, no accelerator."""
