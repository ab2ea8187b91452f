"""An OpenAI-compatible HTTP gateway: a separate process and a gRPC client of the control planes.

It imports only `clients` and `protos`: the planes and the gateway meet in the protocol alone.
"""
