#!/usr/bin/env bash
# Bad input at strata-train's command line: each case must exit non-zero with a message that names
# what is wrong (the offending key, value or path), and must leave an existing checkpoint
# directory exactly as it was. Usage: cli_errors_test.sh STRATA_TRAIN SOURCE_DIR
set -uo pipefail
train="$1"
src="$2"
work=$(mktemp -d "${TMPDIR:-/tmp}/strata-cli-errors.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0

# A small real run to resume from: the tiny config, a few steps, a saved checkpoint.
for i in $(seq 1 400); do echo "line $i: the quick brown fox jumps over the lazy dog $((i * 7919 % 1000))"; done >"$work/data.txt"
# Written here, not derived from configs/: the cases below edit known text.
cat >"$work/good.json" <<'JSON'
{
  "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
  "zero_optimization": {"stage": 1},
  "strata": {"chunk_size": "1MiB"},
  "model": {"n_layers": 1, "d_model": 64, "n_heads": 4, "seq_len": 16, "vocab_size": 256, "seed": 1}
}
JSON
if ! "$train" --config "$work/good.json" --data "$work/data.txt" --steps 2 --save "$work/ckpt" \
     --plot '' >"$work/setup.log" 2>&1; then
  echo "FAIL: the setup run (a valid config) failed:"; cat "$work/setup.log"; exit 1
fi
snapshot() { (cd "$work/ckpt" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
before=$(snapshot)

# expect NAME EXPECTED_SUBSTRING -- ARGS...: non-zero exit, the substring in stderr+stdout.
expect() {
  local name="$1" want="$2"; shift 3
  local out rc
  out=$("$train" "$@" 2>&1); rc=$?
  if [ $rc -eq 0 ]; then
    echo "FAIL [$name]: exit 0 (expected an error)"; failures=$((failures + 1))
  elif ! grep -qiF -- "$want" <<<"$out"; then
    echo "FAIL [$name]: exit $rc but the message does not name '$want':"; echo "$out" | tail -5
    failures=$((failures + 1))
  else
    echo "ok   [$name] exit $rc: $(echo "$out" | grep -iF -- "$want" | head -1 | cut -c1-220)"
  fi
  if [ "$(snapshot)" != "$before" ]; then
    echo "FAIL [$name]: the checkpoint directory changed"; failures=$((failures + 1))
    before=$(snapshot)
  fi
}

common=(--data "$work/data.txt" --steps 3 --plot '')
expect "missing config" "$work/nope.json" -- --config "$work/nope.json" "${common[@]}"

# A typo inside a section is an error naming the closest key (DeepSpeed errors there too); at the
# top level DeepSpeed ignores unknown keys, so Strata runs and warns with the likely spelling.
sed 's/"chunk_size"/"chunk_sise"/' "$work/good.json" >"$work/typo.json"
expect "typo'd key" "did you mean strata.chunk_size" -- --config "$work/typo.json" "${common[@]}"
sed 's/"gradient_clipping"/"gradient_cliping"/' "$work/good.json" >"$work/typo-top.json"
out=$("$train" --config "$work/typo-top.json" --print-config 2>&1); rc=$?
if [ $rc -ne 0 ] || ! grep -qF "did you mean gradient_clipping?" <<<"$out"; then
  echo "FAIL [top-level typo]: exit $rc, expected a warning naming gradient_clipping:"; echo "$out" | tail -3
  failures=$((failures + 1))
else
  echo "ok   [top-level typo] exit 0: $(grep -F "did you mean" <<<"$out" | head -1 | cut -c1-200)"
fi

expect "bad flag value" "--steps" -- --config "$work/good.json" --data "$work/data.txt" --steps banana
expect "negative flag value" "--steps" -- --config "$work/good.json" --data "$work/data.txt" --steps -4

expect "missing --data" "$work/no-such-data" -- --config "$work/good.json" --data "$work/no-such-data" --steps 3 --plot ''

sed 's/"zero_optimization": {"stage": 1}/"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "\/nonexistent\/strata"}}/' \
  "$work/good.json" >"$work/nvme.json"
expect "missing --nvme-path" "/nonexistent/strata" -- --config "$work/nvme.json" "${common[@]}" --nvme-path /nonexistent/strata
mkdir -p "$work/ro" && chmod 0555 "$work/ro"
if [ "$(id -u)" != 0 ]; then  # root writes anywhere: the permission case needs a normal user
  expect "unwritable --nvme-path" "$work/ro" -- --config "$work/nvme.json" "${common[@]}" --nvme-path "$work/ro"
fi
touch "$work/a-file"
expect "--nvme-path is a file" "$work/a-file" -- --config "$work/nvme.json" "${common[@]}" --nvme-path "$work/a-file"

expect "missing --resume" "$work/no-ckpt" -- --config "$work/good.json" "${common[@]}" --resume "$work/no-ckpt"

sed 's/"d_model": 64/"d_model": 32/' "$work/good.json" >"$work/other-model.json"
expect "--resume from another model" "$work/ckpt" -- --config "$work/other-model.json" "${common[@]}" --resume "$work/ckpt"

# A corrupted manifest in a copy (the original must stay intact for the cases above).
cp -r "$work/ckpt" "$work/bad-ckpt"
step=$(cat "$work/bad-ckpt/latest")
printf '{"format": "strata-checkpoint", "version": 1, "rank": ' >"$work/bad-ckpt/$step/rank-00000.json"
bad_before=$(cd "$work/bad-ckpt" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
expect "--resume with a corrupted manifest" "rank-00000.json" -- --config "$work/good.json" "${common[@]}" --resume "$work/bad-ckpt" --save "$work/bad-ckpt"
if [ "$(cd "$work/bad-ckpt" && find . -type f -print0 | sort -z | xargs -0 sha256sum)" != "$bad_before" ]; then
  echo "FAIL [corrupted manifest]: the run wrote into the checkpoint it could not load"; failures=$((failures + 1))
fi

# A `latest` of random bytes: refused without echoing them (they reached the terminal raw).
cp -r "$work/ckpt" "$work/noise-ckpt"
head -c 200 /dev/urandom | tr -d '\n' | sed 's/^/\x01/' >"$work/noise-ckpt/latest"
out=$("$train" --config "$work/good.json" "${common[@]}" --resume "$work/noise-ckpt" 2>&1); rc=$?
if [ $rc -eq 0 ] || ! grep -qF "are not a directory name" <<<"$out"; then
  echo "FAIL [latest of random bytes]: exit $rc:"; echo "$out" | tail -3 | cat -v; failures=$((failures + 1))
elif LC_ALL=C grep -q '[^[:print:][:space:]]' <<<"$out"; then
  echo "FAIL [latest of random bytes]: the message carries unprintable bytes"; failures=$((failures + 1))
else
  echo "ok   [latest of random bytes] exit $rc"
fi

if [ $failures -ne 0 ]; then echo "$failures failure(s)"; exit 1; fi
echo "all CLI error cases passed"
