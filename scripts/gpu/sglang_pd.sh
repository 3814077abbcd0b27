#!/usr/bin/env bash
# A real SGLang prefill/decode pair with --disaggregation-transfer-backend kvconn
# on one GPU host (two GPUs, or one shared with --mem-fraction-static).
#
# NOT RUN YET: written on a CPU-only machine; no GPU host with SGLang was lent.
# docs/sglang.md: the same pair by hand, and what runs on a CPU-only host.
# The host needs sglang (CUDA build, with sgl_kernel) installed; this script
# installs only kvconn's packages (editable, no dependencies) next to it.
#   bash scripts/gpu/sglang_pd.sh      # OUT=/tmp/out, REQUESTS=20, TRANSPORT=nixl
# $OUT gets prefill.log, decode.log, requests.jsonl and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
REQUESTS=${REQUESTS:-20}
TRANSPORT=${TRANSPORT:-nixl}
mkdir -p "$OUT"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

if ! "$PY" -c "import sglang, sgl_kernel" 2>/dev/null; then
    summary "SKIP: sglang with its CUDA kernels is not installed for $PY"
    exit 2
fi
"$PY" -m pip install -q --no-deps -e ./kvconn_core -e ./kvconn_sglang -e ./kvconn_nixl -e ./kvconn_mooncake
"$PY" -c "from sglang.srt.plugins import load_plugins; load_plugins()
from sglang.srt.disaggregation.utils import TransferBackend; TransferBackend('kvconn')" ||
    { summary "FAIL: the kvconn plugin did not register with SGLang"; exit 1; }

# A small Llama with random weights (--load-format dummy): only its config is written.
MODEL="$OUT/model"
"$PY" - "$MODEL" <<'PY'
import sys
from transformers import LlamaConfig
LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=4096, max_position_embeddings=2048,
            torch_dtype="bfloat16").save_pretrained(sys.argv[1])
PY
GPUS=$(nvidia-smi -L | wc -l)
DECODE_GPU=$(( GPUS > 1 ? 1 : 0 ))
COMMON=(--model-path "$MODEL" --load-format dummy --skip-tokenizer-init --mem-fraction-static 0.3
        --disaggregation-transfer-backend kvconn --host 127.0.0.1)
export KVCONN_SGLANG_TRANSPORT=$TRANSPORT KVCONN_SGLANG_HOST=127.0.0.1 KVCONN_SGLANG_MEMORY=vram
KVCONN_SGLANG_PORT_BASE=17000 "$PY" -m sglang.launch_server "${COMMON[@]}" --port 30000 \
    --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 --base-gpu-id 0 \
    >"$OUT/prefill.log" 2>&1 &
PREFILL=$!
# Decode finds the prefill's kvconn ranks per request, at the bootstrap server the request names.
"$PY" -m sglang.launch_server "${COMMON[@]}" \
    --port 30001 --disaggregation-mode decode --base-gpu-id "$DECODE_GPU" >"$OUT/decode.log" 2>&1 &
DECODE=$!
trap 'kill $PREFILL $DECODE 2>/dev/null; wait $PREFILL $DECODE 2>/dev/null' EXIT

"$PY" - "$OUT" "$REQUESTS" <<'PY'
"""Wait for both servers, then send each request to prefill and decode at once
(what SGLang's PD router does) and record what decode answers."""
import json, random, sys, threading, time, urllib.request
out, n = sys.argv[1], int(sys.argv[2])

def post(port, path, body, timeout=120):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")

deadline = time.time() + 300
for port in (30000, 30001):
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5); break
        except Exception:
            if time.time() > deadline: sys.exit(f"server on {port} not up after 300 s")
            time.sleep(2)
ok = 0
with open(f"{out}/requests.jsonl", "w") as log:
    for i in range(n):
        body = {"input_ids": [random.randrange(1, 4000) for _ in range(random.choice((64, 700, 1500)))],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                "bootstrap_room": random.getrandbits(63), "rid": f"pd-{i}"}
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("prefill", post(30000, "/generate", body)))
        t.start()
        t0 = time.time()
        try:
            got["decode"] = post(30001, "/generate", body)
        except Exception as exc:
            got["error"] = repr(exc)
        t.join(120)
        rec = {"rid": body["rid"], "tokens": len(body["input_ids"]), "s": round(time.time() - t0, 3),
               "output_ids": (got.get("decode") or {}).get("output_ids"), "error": got.get("error")}
        ok += bool(rec["output_ids"])
        log.write(json.dumps(rec) + "\n")
print(f"{ok}/{n} requests decoded through kvconn")
PY
RC=$?
summary "requests: rc=$RC $(tail -1 "$OUT/requests.jsonl" 2>/dev/null | head -c 200)"
summary "kvconn log lines: prefill $(grep -c kvconn "$OUT/prefill.log") decode $(grep -c kvconn "$OUT/decode.log")"
exit $RC
