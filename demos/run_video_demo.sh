#!/usr/bin/env bash
# Video QA demo: a 10-minute synthetic world video made here with PyAV (so it runs on a fresh
# machine), then the real videos in ../shared/data/videos when that folder exists.
#
#   demos/run_video_demo.sh [OUT_DIR]      (default runs/video-demo)
#
# KAMERA_MODEL: a Qwen2.5-VL checkpoint folder. Default: tools/world/world_vl when it holds
# weights, else the random-weight "tiny" model (answers are then noise; the cache figures are real).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/video-demo}
mkdir -p "$OUT"
MODEL=${KAMERA_MODEL:-}
if [[ -z "$MODEL" ]]; then
  if compgen -G "tools/world/world_vl/*.safetensors" > /dev/null; then MODEL=tools/world/world_vl; else
    echo "tools/world/world_vl has no weights: using the random-weight tiny model" >&2; MODEL=tiny; fi
fi
DATA=${KAMERA_DATA:-../shared/data}

python - "$OUT/world-10min.mp4" <<'PY'
import sys
from tools.world.render import make_split, write_video
write_video(make_split("test", 100), sys.argv[1], fps=1)  # 100 episodes x 6 frames = 600 s at 1 fps
PY

python -m agent.cli video-qa "$OUT/world-10min.mp4" --model "$MODEL" --fps 1 --budget 4096 --retrieval even \
  -q "What colour is the star?" --at 02:00 \
  -q "Which shape moved last?" --at 04:00 \
  -q "What digit is on the square?" --at 06:00 \
  -q "How many objects are there?" --at 08:00 \
  -q "Where is the circle?" \
  --compare --json "$OUT/world-10min.json"

if [[ -d "$DATA/videos" ]]; then
  for video in "$DATA"/videos/*.mp4 "$DATA"/videos/*.webm; do
    name=$(basename "$video")
    python -m agent.cli video-qa "$video" --model "$MODEL" --fps 1 --max-pixels 200704 --budget 4096 \
      --retrieval similarity -q "What happens at the start?" --at 5 -q "What happens at the end?" \
      --compare --json "$OUT/${name%.*}.json"
  done
else
  echo "no $DATA/videos: skipping the real videos" >&2
fi
