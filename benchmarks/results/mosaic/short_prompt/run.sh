# A short prompt's attention launch under ncu (stalls.py), Mosaic tiles unsplit / split-K and Triton.
# Run from the repository root: bash benchmarks/results/mosaic/short_prompt/run.sh [stalls.py arguments]
export PYTHONUNBUFFERED=1
ncu --clock-control none -k regex:attention --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section LaunchStats --section Occupancy --section SourceCounters \
    python3 benchmarks/results/mosaic/short_prompt/stalls.py "$@" > $OUT/stalls_ncu.txt 2>&1
grep -v -E "W0000|I0000|W12|E12" $OUT/stalls_ncu.txt | grep -E "max abs|^  [a-z_]+.*\(|Duration|Registers Per|Dynamic Shared|Theoretical Occ|Achieved Occ|Warp Cycles Per Issued|Stall|stall" | head -80
