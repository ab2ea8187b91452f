"""Write a small lm-eval-harness task that runs offline against the gateway: multiple choice over the
bundled English corpus (stepwise/assets/corpus/english.txt), each item a sentence's first half with
its true second half among three taken from other sentences. Every choice is scored by the gateway's
`/v1/completions` with `echo` and `logprobs` (lm-eval's loglikelihood request), so the task checks
that path end to end; the embedded model was trained on this text, so it should beat chance (0.25).

    .venv/bin/python bench/lm_eval_task.py --out /tmp/lmtask
    lm_eval --model local-completions --tasks stepwise_local_mc --include_path /tmp/lmtask \\
      --model_args $ARGS --batch_size 4

with ARGS=base_url=http://127.0.0.1:8000/v1/completions,model=embedded,tokenizer=MODEL_DIR,\
tokenized_requests=True (one word; MODEL_DIR the embedded model's directory).

(lm-eval is not a dependency of Stepwise: install `lm-eval[api]` and transformers in a venv of their
own; set HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1.)
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "stepwise" / "assets" / "corpus" / "english.txt"
TASK = """task: stepwise_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def items(count: int, seed: int) -> list[dict[str, object]]:
    text = CORPUS.read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 < len(s.strip()) < 200]
    rng = random.Random(seed)
    rng.shuffle(sentences)
    out = []
    for sentence in sentences[:count]:
        words = sentence.split()
        half = len(words) // 2
        others = rng.sample([s for s in sentences if s != sentence], 3)
        choices = [" " + " ".join(o.split()[len(o.split()) // 2 :]) for o in others]
        label = rng.randrange(4)
        choices.insert(label, " " + " ".join(words[half:]))
        out.append({"context": " ".join(words[:half]), "choices": choices, "label": label})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the task into")
    parser.add_argument("--items", type=int, default=40, help="questions (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    data = ns.out / "data.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items(ns.items, ns.seed)))
    (ns.out / "stepwise_local_mc.yaml").write_text(TASK.format(data=data.resolve()))
    print(f"wrote {data} and {ns.out / 'stepwise_local_mc.yaml'}")


if __name__ == "__main__":
    main()
