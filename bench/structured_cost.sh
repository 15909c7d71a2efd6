#!/usr/bin/env bash
# What a structured-output mask costs CPU decode: the same greedy chat reply generated plain and
# under a grammar that allows any text (so the tokens are identical and only the mask work
# differs), then a reply held to a JSON schema. Three interleaved rounds; the best decode rate of
# each kind is reported (on a shared machine other work can only slow a run down).
#
#   bench/structured_cost.sh [MODEL] [THREADS]    (default model, 2 threads)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${NIBBLE_BIN:-target/release/nibble}
MODEL=${1:+--model $1}
THREADS=${2:-2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'start: /(.|\\n)*/\n' > "$tmp/any.lark"
cat > "$tmp/schema.json" <<'JSON'
{"type": "object", "properties": {
  "title": {"type": "string", "maxLength": 60},
  "characters": {"type": "array", "items": {"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 500},
      "role": {"enum": ["hero", "villain", "mentor", "sidekick"]}},
    "required": ["name", "age", "role"], "additionalProperties": false}, "minItems": 3, "maxItems": 6},
  "summary": {"type": "string", "maxLength": 300}},
 "required": ["title", "characters", "summary"], "additionalProperties": false}
JSON
PROMPT="Write a long story about a dragon who learns to cook. Describe its characters."
rate() { sed -n 's/.* \([0-9]*\) generated at \([0-9.]*\) tok\/s.*/\1 \2/p'; }
run() { # $@: extra flags; prints "tokens tok/s"
  # shellcheck disable=SC2086
  "$BIN" $MODEL --threads "$THREADS" generate --chat --prompt "$PROMPT" --max-tokens 160 "$@" 2>&1 >/dev/null | rate
}
best() { sort -k2 -n -r | head -1; }
: > "$tmp/plain"; : > "$tmp/any"; : > "$tmp/json"
for round in 1 2 3; do
  run >> "$tmp/plain"
  run --grammar "$tmp/any.lark" >> "$tmp/any"
  run --json-schema "$tmp/schema.json" >> "$tmp/json"
done
echo "runs (tokens tok/s): plain $(tr '\n' ' ' < "$tmp/plain")| any-text grammar $(tr '\n' ' ' < "$tmp/any")| JSON schema $(tr '\n' ' ' < "$tmp/json")"
read -r pn pr < <(best < "$tmp/plain")
read -r an ar < <(best < "$tmp/any")
read -r jn jr < <(best < "$tmp/json")
echo "plain:            $pn tokens, $pr tok/s"
echo "any-text grammar: $an tokens, $ar tok/s ($(python3 -c "print(f'{($ar / $pr - 1) * 100:+.1f}%')"))"
echo "JSON schema:      $jn tokens, $jr tok/s ($(python3 -c "print(f'{($jr / $pr - 1) * 100:+.1f}%')"))"
