# Alternate processes of two checkouts on steps.py: OLD (a worktree of the base) and NEW.
# usage: OLD=/tmp/ab_old NEW=. B=256 STEPS=100 bash docs/cpu/host_step_s18/ab.sh PAIRS
# (first: python docs/cpu/simdevice_s17/make.py, which writes /tmp/simdevice-model)
here=$(cd "$(dirname "$0")" && pwd)
hook=$(cd "$here/../simdevice_s17" && pwd)
for i in $(seq 1 "${1:-3}"); do
  for side in OLD NEW; do
    dir=$(cd "${!side}" && pwd)
    echo "== $side $(git -C "$dir" rev-parse --short HEAD)"
    (cd "$dir" && OMP_NUM_THREADS=1 PYTHONPATH="$dir:$hook" FAKE_DEV=0.01,0,0 FAKE_GRAPH=1 \
      B=${B:-256} STEPS=${STEPS:-100} ROUNDS=${ROUNDS:-4} .venv/bin/python "$here/steps.py" 2>&1 | grep -v fakedev)
  done
done
