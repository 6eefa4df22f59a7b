#!/usr/bin/env bash
# One-shot `expertmesh bench dispatch` and `bench serve` on the GPU machine (see README.md here).
#
# Installs the carried wheels (make gpu-wheels) into a private folder first on PYTHONPATH, records the
# environment in $OUT/env.txt, builds the 214M-parameter Mixtral checkpoint, then runs, per model, a
# dispatch benchmark per transport and a serve benchmark, each under a timeout, logging to
# $OUT/<name>.log and writing $OUT/<name>.json.
# A failed or timed-out benchmark does not stop the next. Exit 0 when at least one JSON was written.
#
# Settings (environment, or the flags below):
#   OUT            output folder (required)
#   DEVICE         --device of bench dispatch: auto|cpu|cuda (default cuda)
#   DTYPE          default bfloat16
#   BATCHES        decode batch sizes (default 1,8,32)
#   MODELS         "tiny" and/or "mixtral-h512-l8-e8" (the 214M model), space-separated (default both)
#   TRANSPORTS     default "auto grpc"
#   REPEATS        dispatch --repeats for the tiny model (default 5); REPEATS_BIG for the 214M model (default 3)
#   BENCH_ARGS     extra arguments for every bench dispatch (e.g. "--prefill-tokens 32 --decode-steps 2")
#   SERVE_ARGS     arguments of every bench serve (default "--clients 8 --requests-per-client 2 --repeats 3");
#                  SERVE=0 skips the serve runs
#   BENCH_TIMEOUT  seconds per benchmark (default 150); BUDGET: seconds for the whole script (default 500):
#                  a benchmark never runs past it, so the script ends within BUDGET + 25 s
#   PYTHON         default python3; WHEELS default build/gpu-wheels; SITE default /tmp/expertmesh-site
#   MODELS_DIR     where the 214M checkpoint is built (default /tmp/bench-models)
#
# On CPU here, e.g.:
#   OUT=/tmp/gpu-bench DEVICE=cpu DTYPE=float32 BATCHES=1 MODELS=tiny bash deploy/gpu-bench/run.sh
set -euo pipefail

START=$SECONDS
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --batches) BATCHES=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --transports) TRANSPORTS=$2; shift 2 ;;
    --repeats) REPEATS=$2; REPEATS_BIG=$2; shift 2 ;;
    --timeout) BENCH_TIMEOUT=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

: "${OUT:?set OUT to the output folder}"
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
BATCHES=${BATCHES:-1,8,32}
MODELS=${MODELS:-tiny mixtral-h512-l8-e8}
TRANSPORTS=${TRANSPORTS:-auto grpc}
REPEATS=${REPEATS:-5}
REPEATS_BIG=${REPEATS_BIG:-3}
BENCH_ARGS=${BENCH_ARGS:-}
SERVE_ARGS=${SERVE_ARGS:---clients 8 --requests-per-client 2 --repeats 3}
SERVE=${SERVE:-1}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
BUDGET=${BUDGET:-500}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-build/gpu-wheels}
SITE=${SITE:-/tmp/expertmesh-site}
MODELS_DIR=${MODELS_DIR:-/tmp/bench-models}

cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ENV_TXT=$OUT/env.txt
SUMMARY=$OUT/summary.txt
: >"$ENV_TXT"
: >"$SUMMARY"
log() { echo "[run.sh +$((SECONDS - START))s] $*" | tee -a "$SUMMARY"; }

# -- the carried wheels, first on the path ------------------------------------------------
rm -rf "$SITE" && mkdir -p "$SITE"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
log "installing ${#wheels[@]} wheels from $WHEELS into $SITE"
if [[ ${#wheels[@]} -gt 0 ]]; then
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$SITE" "${wheels[@]}" >"$OUT/wheels.log" 2>&1; then
      # one that does not fit this Python (a cp312 wheel on 3.11, say) fails them all: one at a time
      log "pip install of all wheels failed (see wheels.log); installing one at a time"
      for w in "${wheels[@]}"; do
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
          --target "$SITE" "$w" >>"$OUT/wheels.log" 2>&1 || log "wheel NOT installed: $(basename "$w")"
      done
    fi
  else  # no pip: a wheel is a zip of what goes into site-packages (none of these carries a .data folder)
    log "no pip for $PYTHON: unpacking the wheels"
    "$PYTHON" - "$SITE" "${wheels[@]}" <<'EOF' >"$OUT/wheels.log" 2>&1
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
    print("unpacked", w)
EOF
  fi
fi
export PYTHONPATH="$SITE:$PWD/services:$PWD/orchestrator${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

# -- the environment ------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)  cpus: $(nproc)"
  echo "settings: DEVICE=$DEVICE DTYPE=$DTYPE BATCHES=$BATCHES MODELS='$MODELS' TRANSPORTS='$TRANSPORTS'" \
    "REPEATS=$REPEATS REPEATS_BIG=$REPEATS_BIG BENCH_ARGS='$BENCH_ARGS' BENCH_TIMEOUT=$BENCH_TIMEOUT BUDGET=$BUDGET"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --short 2>/dev/null | wc -l) changed paths"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  timeout -k 10 120 "$PYTHON" - <<'EOF'
import importlib, importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
except Exception as e:
    print("torch: import failed:", repr(e))
for dist in ["transformers", "huggingface_hub", "tokenizers", "safetensors", "regex", "grpcio", "protobuf",
             "numpy", "pydantic", "pydantic-settings", "opentelemetry-api", "httpx2", "typing_extensions"]:
    try:
        print(f"{dist} {md.version(dist)} ({md.distribution(dist).locate_file('')})")
    except md.PackageNotFoundError:
        print(f"{dist} MISSING")
for mod in ["ray", "redis", "opentelemetry.sdk"]:
    try:
        importlib.import_module(mod)
        print(f"{mod}: present")
    except ImportError:
        print(f"{mod}: absent")
try:
    import transformers, expertmesh.cli.main, expertmesh.v1.experts_pb2_grpc  # noqa: F401
    print("imports ok: transformers, expertmesh.cli.main, expertmesh.v1")
except Exception as e:
    print("IMPORT FAILED:", repr(e))
EOF
} >>"$ENV_TXT" 2>&1 || true
cat "$ENV_TXT"

EM=("$PYTHON" -m expertmesh.cli.main)

# -- one benchmark under the timeout; timeout makes its own process group (pgid = its pid), so the
# group servers the benchmark starts can be ended with it ------------------------------------------
ok=0
bench() {  # bench NAME dispatch|serve ARGS...
  local name=$1; shift
  local left=$((BUDGET - (SECONDS - START) - 5))
  local limit=$((left < BENCH_TIMEOUT ? left : BENCH_TIMEOUT))
  if ((limit < 30)); then
    log "$name: SKIPPED (${left}s left of the ${BUDGET}s budget)"
    return
  fi
  log "$name: start (timeout ${limit}s): bench $*"
  local t0=$SECONDS rc=0
  # SIGINT first: the benchmark's finally blocks stop its group processes; SIGKILL 20 s later
  timeout -s INT -k 20 "$limit" "${EM[@]}" bench "$@" --out "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 &
  local pid=$!
  wait "$pid" || rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true  # anything of its process group still there
  if [[ -s "$OUT/$name.json" ]]; then
    ok=$((ok + 1))
    log "$name: ok in $((SECONDS - t0))s"
  else
    log "$name: FAILED rc=$rc in $((SECONDS - t0))s$( ((rc == 124)) && echo ' (timed out)'); log tail:"
    tail -n 15 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  fi
}

for model in $MODELS; do
  case "$model" in
    tiny)
      model_args=()
      repeats=$REPEATS
      ;;
    mixtral-h512-l8-e8)
      path=$MODELS_DIR/mixtral-h512-l8-e8
      if [[ ! -f $path/config.json ]]; then
        log "building the 214M checkpoint in $path"
        if ! timeout -k 10 180 "$PYTHON" -c "from expertmesh.models.tiny import make_tiny_checkpoint; make_tiny_checkpoint('mixtral', '$path', with_tokenizer=True, vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)" \
            >"$OUT/make-checkpoint.log" 2>&1; then
          log "building the checkpoint FAILED:"; tail -n 15 "$OUT/make-checkpoint.log" | tee -a "$SUMMARY"
          continue
        fi
        log "checkpoint built"
      fi
      model_args=(--model "$path")
      repeats=$REPEATS_BIG
      ;;
    *) log "unknown model $model (tiny, mixtral-h512-l8-e8)"; continue ;;
  esac
  for transport in $TRANSPORTS; do
    # shellcheck disable=SC2086  # BENCH_ARGS is split into words on purpose
    bench "dispatch-$model-$transport" dispatch "${model_args[@]}" --repeats "$repeats" --device "$DEVICE" \
      --dtype "$DTYPE" --groups-as process --transport "$transport" --batches "$BATCHES" $BENCH_ARGS
  done
  if [[ $SERVE != 0 ]]; then
    # shellcheck disable=SC2086  # SERVE_ARGS likewise
    bench "serve-$model" serve "${model_args[@]}" --device "$DEVICE" --dtype "$DTYPE" --groups-as process $SERVE_ARGS
  fi
done

# the tables, for the run's output tail
for f in "$OUT"/dispatch-*.log "$OUT"/serve-*.log; do
  [[ -s ${f%.log}.json ]] || continue
  echo "== $(basename "${f%.log}")"
  grep -v -e '^\[expertmesh\]' -e 'Loading weights' "$f" | tail -n 12
done
log "done: $ok JSON file(s) in $OUT, $((SECONDS - START))s"
((ok > 0))
