"""The core process of a control plane: every decision, one step loop per worker."""
