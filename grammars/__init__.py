"""Constrained decoding's grammars, shared by both planes: what a client's constraint is
(`spec`), and the backends that compile it and match tokens against it (`backend`).

The control plane compiles a constraint once to refuse a bad one before it is queued; a worker
compiles it again, from its own cache, into one matcher per sequence, and fills each step's
token bitmask from it. Nothing here imports either plane, torch or transformers: a backend is
built from a `tokenizer.json` text, and bitmasks are numpy int32 words (bit j of word w allows
token 32·w + j, the layout both llguidance and xgrammar use).
"""
