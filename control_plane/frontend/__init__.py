"""A frontend process of a control plane: the client API, tokenizing, streaming."""
