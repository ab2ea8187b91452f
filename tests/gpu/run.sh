#!/usr/bin/env bash
# Run the CUDA checks (tests/gpu, marker `gpu`) on a machine with an NVIDIA GPU, then the GPU report
# (tests/gpu/gpu_report.py: greedy equality, decode tokens/s and HBM roofline on a random
# Llama-3.2-1B-shaped checkpoint). The whole command is sized to finish well inside 10 minutes on one
# GPU; keep it so when adding checks or report flags.
#
#   tests/gpu/run.sh [PYTEST ARGS]
#   STEPWISE_GPU_REPORT_ARGS="--json /tmp/gpu-report.json --peak-gbps 3350" tests/gpu/run.sh
#
# Arguments go to pytest; the report's flags come from $STEPWISE_GPU_REPORT_ARGS (split on spaces).
# The report runs even when pytest fails; the exit status is pytest's if non-zero, else the report's.
#
# Uses $PYTHON as it is, or the repo's .venv when it has the packages and sees CUDA; otherwise it
# makes a fresh venv ($STEPWISE_GPU_VENV, default /tmp/stepwise-gpu-venv) with the packages below.
# If that venv's torch cannot see CUDA (a CPU wheel), torch==2.13.0 is reinstalled there from the
# default index, which on a GPU machine is the CUDA build. Nothing else is installed.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
packages=(torch==2.13.0 transformers safetensors numpy pytest pytest-timeout grpcio protobuf structlog tokenizers)

has_deps() {
  "$1" -c 'import torch, transformers, safetensors, numpy, pytest, pytest_timeout, structlog' 2>/dev/null
}

cuda_ok() {
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
}

python="${PYTHON:-}"
if [[ -n "$python" ]]; then
  # A caller-chosen interpreter is used as it is: never reinstall into someone else's environment.
  "$python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
elif [[ -x .venv/bin/python ]] && has_deps .venv/bin/python && cuda_ok .venv/bin/python; then
  python=.venv/bin/python
  "$python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
else
  venv="${STEPWISE_GPU_VENV:-/tmp/stepwise-gpu-venv}"
  [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
  python="$venv/bin/python"
  has_deps "$python" || "$python" -m pip install "${packages[@]}"
  "$python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
  if ! cuda_ok "$python"; then
    echo "torch cannot see CUDA; reinstalling torch==2.13.0 in $venv from the default index" >&2
    "$python" -m pip install --force-reinstall --no-deps torch==2.13.0
    "$python" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
  fi
fi

# -p no:cacheprovider: the checkout may be read-only; PYTHONPATH: the tests import the repo's packages.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
pytest_status=0
"$python" -m pytest -m gpu tests/gpu -v -p no:cacheprovider "$@" || pytest_status=$?

read -r -a report_args <<<"${STEPWISE_GPU_REPORT_ARGS:-}"
report_status=0
"$python" tests/gpu/gpu_report.py "${report_args[@]}" || report_status=$?

if ((pytest_status != 0)); then
  exit "$pytest_status"
fi
exit "$report_status"
