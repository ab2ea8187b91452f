"""The data plane: a worker that dials the control plane and executes step plans."""
