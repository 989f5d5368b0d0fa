#!/bin/bash
# interleaved A/B of the c=64 served run on a simulated device, from the repository root:
# OLD (a git worktree of the base, with .venv linked) vs NEW (this checkout)
HERE=$PWD
export FAKE_DEV=${FAKE_DEV:-1.8,0.019,0.0066} MODEL=/tmp/simdevice-model PYTHONPATH=$HERE/docs/cpu/simdevice_s17 OMP_NUM_THREADS=1 FAKE_GRAPH=1
MODE=${MODE:-"--transfer grpc --async-scheduling on"}
for r in $(seq ${ROUNDS:-2}); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"  # no side always first
  for t in $order; do
    root=${NEW:-$HERE}; [ $t = old ] && root=${OLD:-/tmp/ab_old}
    # the checkout first on the path: the hook imports the engine before anything else does,
    # and would otherwise take it from the venv's editable install (the main checkout)
    cd $root && echo "$t: $(PYTHONPATH=$root:$PYTHONPATH ROOT=$root N=${N:-384} timeout 600 .venv/bin/python $HERE/docs/cpu/simdevice_s17/served.py "$MODE" 2>&1 | grep 'c=64\|ttft' | tr '\n' ' ')"
  done
done
