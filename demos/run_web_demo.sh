#!/usr/bin/env bash
# Web agent demo: the sample shop (demos/sample_site) served on loopback and toured by a scripted
# policy, then a few saved pages from ../shared/data/web_pages when that folder exists (served on
# loopback; every request to another origin is blocked by the browser's allowlist).
#
#   demos/run_web_demo.sh [OUT_DIR]        (default runs/web-demo)
#
# KAMERA_MODEL as in run_video_demo.sh; the model runs on every screenshot (cache figures), the
# actions come from the script.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/web-demo}
mkdir -p "$OUT"
MODEL=${KAMERA_MODEL:-}
if [[ -z "$MODEL" ]]; then
  if compgen -G "tools/world/world_vl/*.safetensors" > /dev/null; then MODEL=tools/world/world_vl; else
    echo "tools/world/world_vl has no weights: using the random-weight tiny model" >&2; MODEL=tiny; fi
fi
DATA=${KAMERA_DATA:-../shared/data}

serve_and_run() {  # ROOT START_PAGE RUN_NAME SCRIPT
  python - "$@" "$MODEL" "$OUT" <<'PY'
import sys
from demos.web_agent import main
from tools.browser import serve_directory

root, page, name, script, model, out = sys.argv[1:]
with serve_directory(root) as server:
    code = main(["--start-url", server.url + page, "--task", f"look through {page}", "--policy", script,
                 "--model", model, "--viewport", "640x400", "--keep", "3", "--max-steps", "20",
                 "--out", f"{out}/{name}", "--json", f"{out}/{name}.json"])
print(f"report: {out}/{name}/report.html")
sys.exit(code)
PY
}

serve_and_run demos/sample_site index.html sample-site demos/sample_site/script.json

if [[ -d "$DATA/web_pages" ]]; then
  printf '%s\n' '["scroll(0, 400)", "scroll(0, 400)", "scroll(0, -800)", "done(\"read the page\")"]' \
    > "$OUT/scroll.json"
  for page in readability_wikipedia-4.html readability_bbc-1.html readability_ietf-1.html; do
    serve_and_run "$DATA/web_pages" "$page" "${page%.html}" "$OUT/scroll.json"
  done
else
  echo "no $DATA/web_pages: skipping the saved pages" >&2
fi
