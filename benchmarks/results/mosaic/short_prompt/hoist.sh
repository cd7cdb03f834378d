# hoist_ab.py against the kernel before hoist.patch (a copy with the patch reversed), then the GPU check.
# Run from the repository root: bash benchmarks/results/mosaic/short_prompt/hoist.sh
export PYTHONUNBUFFERED=1
D=benchmarks/results/mosaic/short_prompt
F='W0000|I0000|W12|E12|DeprecationWarning|cuda_event|warnings.warn|^WARNING'
before=$(mktemp -d)/paged_attention_mgpu_before.py
cp kernels/paged_attention_mgpu.py $before && patch -s -R $before < <(sed 's#kernels/paged_attention_mgpu.py#'$before'#' $D/hoist.patch) || exit 1
timeout 400 python3 $D/hoist_ab.py --before $before 2>&1 | grep --line-buffered -v -E "$F" > $OUT/hoist_ab.log; tail -13 $OUT/hoist_ab.log
timeout 150 python3 benchmarks/check_attention_mgpu.py --only check --out $OUT/check 2>&1 | grep -v -E "$F" > $OUT/check.log; grep -E "errors" $OUT/check.log | tail -2
