#!/usr/bin/env bash
# Serving benchmark on the GPU machine: `pagedllm serve` on a Qwen3-0.6B-shaped random-weight model, then a
# request-rate sweep with benchmarks/serving.py. Needs fastapi/uvicorn/openai there (carried as wheels).
source "$(dirname "$0")/env.sh"
PORT=${PORT:-18000}
model=$(mktemp -d)
cat > "$model/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
 "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
 "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "tie_word_embeddings": true, "dtype": "bfloat16"}
JSON
$PY -m pagedllm serve "$model" --load-format dummy --port "$PORT" --max-model-len 4096 \
    > "$OUT/serve.log" 2>&1 &
server=$!
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
$PY benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --request-rates "${RATES:-4,16,64,inf}" \
    --num-prompts "${NUM_PROMPTS:-256}" --input-len 256 --output-len 128 --output "$OUT/serving.json"
status=$?
kill "$server"
exit $status
