"""The embedded demo model: a tiny Llama checkpoint that ships with Stepwise.

`resolve()` gives the committed checkpoint directory (or builds one into the user cache when the
committed files are missing); `stepwise.models` maps `--model embedded` to it.

`python -m stepwise.embedded build --out DIR` reproduces the checkpoint from the shipped corpus:
a byte-level BPE tokenizer trained with `tokenizers`, then a ~0.9M-parameter Llama trained for a
few hundred steps. Seeds and the thread count are fixed so the build is deterministic on one
machine; transformers is imported only here, at build time, never by the worker.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from stepwise.cache import cache_root

ASSETS_DIR = pathlib.Path(__file__).resolve().parent / "assets"
EMBEDDED_DIR = ASSETS_DIR / "embedded"
CORPUS_PATH = ASSETS_DIR / "corpus" / "english.txt"
EMBEDDED_SPEC = "embedded"
EOS_TOKEN = "<|endoftext|>"
# The demo's chat template (transformers' Jinja conventions): plain "User:" / "Assistant:" turns, close
# to the prose the model was trained on, so `/v1/chat/completions` has something to render. Tools are
# rendered in the Hermes/Qwen style the gateway's default tool-call parser reads (gateway/tools.py):
# the tools as JSON lines inside <tools></tools> after the system text, an assistant's calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a tool's result as a "Tool:" turn holding
# a <tool_response> block. Only this text changes the template; the weights and tokenizer do not
# depend on it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ (messages[0]['content'] or '') + '\\n\\n' }}"
    "{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\\n\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not (tools and loop.first) %}{{ (message['content'] or '') + '\\n\\n' }}{% endif %}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + (message['content'] or '') + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ 'Tool: <tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>\\n' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Files whose presence means a checkpoint directory is complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")


@dataclass(frozen=True, slots=True)
class BuildSpec:
    """Everything that determines the embedded checkpoint; changing a field changes the weights."""

    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    seq_len: int = 128
    batch_size: int = 16
    train_steps: int = 400
    peak_lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 1234
    # Fixed so float reductions happen in the same order on every build.
    threads: int = 2


def resolve() -> pathlib.Path:
    """The committed checkpoint, or one built into `$XDG_CACHE_HOME/stepwise/embedded`
    (`~/.cache/stepwise/embedded`) if the committed files are missing."""
    if is_complete(EMBEDDED_DIR):
        return EMBEDDED_DIR
    cached = cache_root() / "embedded"
    if not is_complete(cached):
        build(cached)
    return cached


def is_complete(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def build(out: pathlib.Path, spec: BuildSpec = BuildSpec(), log: bool = False) -> pathlib.Path:
    """Train the tokenizer and the model and write a complete checkpoint into `out`.

    Writes into a sibling temporary directory first and renames it, so a crashed build never
    leaves a half-written checkpoint that `resolve_model` would accept.
    """
    # Must be set before the tokenizers library starts its thread pool.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = out.resolve()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=False)
    try:
        _build_into(tmp, spec, log)
    except BaseException:
        _remove_tree(tmp)
        raise
    if out.exists():
        _remove_tree(out)
    tmp.rename(out)
    return out


def _build_into(out: pathlib.Path, spec: BuildSpec, log: bool) -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer = _train_tokenizer(text, spec)
    _save_tokenizer(tokenizer, out, spec)
    ids = _encode_corpus(tokenizer, text)
    model = _train_model(ids, spec, log)
    _save_model(model, spec, out)


def _remove_tree(path: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(path)


def _train_tokenizer(text: str, spec: BuildSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_documents(text), trainer=trainer)
    return tokenizer


def _documents(text: str) -> list[str]:
    """Paragraphs of the corpus; each becomes one document separated by EOS in training."""
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _save_tokenizer(tokenizer: Any, out: pathlib.Path, spec: BuildSpec) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=spec.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))


def _encode_corpus(tokenizer: Any, text: str) -> list[int]:
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for doc in _documents(text):
        ids.append(eos)
        ids.extend(tokenizer.encode(doc).ids)
    return ids


def _llama_config(spec: BuildSpec, eos_id: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        architectures=["LlamaForCausalLM"],
    )


def _train_model(ids: list[int], spec: BuildSpec, log: bool) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_llama_config(spec, eos_id=0)).float()
    model.train()
    data = torch.tensor(ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.peak_lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.monotonic()
    for step in range(spec.train_steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, spec)
        batch = _sample_batch(data, spec, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log and (step % 50 == 0 or step == spec.train_steps - 1):
            print(f"step {step} loss {loss.item():.3f} t={time.monotonic() - start:.1f}s", file=sys.stderr)
    model.eval()
    return model


def _lr_at(step: int, spec: BuildSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.peak_lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.train_steps - spec.warmup_steps)
    return spec.peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _sample_batch(data: Any, spec: BuildSpec, gen: Any) -> Any:
    import torch

    starts = torch.randint(0, len(data) - spec.seq_len, (spec.batch_size,), generator=gen)
    return torch.stack([data[s : s + spec.seq_len] for s in starts.tolist()])


def _save_model(model: Any, spec: BuildSpec, out: pathlib.Path) -> None:
    from transformers import GenerationConfig

    model.save_pretrained(str(out), safe_serialization=True)
    gen = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    gen.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    """`python -m stepwise.embedded build --out DIR` (default: the committed assets directory)."""
    parser = argparse.ArgumentParser(prog="python -m stepwise.embedded")
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="train the embedded tokenizer and model into --out")
    build_cmd.add_argument("--out", type=pathlib.Path, default=EMBEDDED_DIR)
    ns = parser.parse_args(argv)
    started = time.monotonic()
    out = build(ns.out, log=True)
    print(f"built {out} in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
