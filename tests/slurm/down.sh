#!/usr/bin/env bash
# Stop the one-node cluster of tests/slurm/up.sh (make slurm-down): cancel its jobs, end the job steps it left,
# then slurmd, slurmctld, slurmdbd, MariaDB and munged, each by the pid file it wrote under $H2O_SLURM_DIR.
# Safe to run when nothing is up. The scratch folder stays (logs); up.sh starts from a fresh one.
set -uo pipefail

S=${H2O_SLURM_DIR:-/tmp/h2o-slurm}
export SLURM_CONF=$S/slurm.conf PATH=$PATH:/usr/sbin:/sbin
[ -d "$S" ] || { echo "slurm-down: nothing under $S"; exit 0; }

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
stop() {  # stop <pid...>: TERM, then KILL after 10 s
  local pid left=() i
  for pid in "$@"; do alive "$pid" && kill -TERM "$pid" 2>/dev/null && left+=("$pid"); done
  for i in $(seq 50); do
    local still=()
    for pid in "${left[@]}"; do alive "$pid" && still+=("$pid"); done
    [ ${#still[@]} = 0 ] && return 0
    left=("${still[@]}"); sleep 0.2
  done
  kill -KILL "${left[@]}" 2>/dev/null || true
}
pidfile() { [ -s "$S/$1.pid" ] && cat "$S/$1.pid"; }

if alive "$(pidfile slurmctld)"; then
  timeout 10 scancel --full -u root 2>/dev/null || true
  for i in $(seq 20); do [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
fi
stop $(pidfile slurmd)
# job steps left by slurmd: slurmstepd processes started from this cluster's configuration (their environment)
steps=()
for d in /proc/[0-9]*; do
  [ "$(readlink "$d/exe" 2>/dev/null)" = /usr/sbin/slurmstepd ] || continue
  tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qx "SLURM_CONF=$S/slurm.conf" && steps+=("${d#/proc/}")
done
[ ${#steps[@]} = 0 ] || stop "${steps[@]}"
stop $(pidfile slurmctld)
stop $(pidfile slurmdbd)
stop $(pidfile mariadbd)
stop $(pidfile munged)
echo "slurm-down: stopped (logs in $S/log)"
