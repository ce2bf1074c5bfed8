#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_slurm_real.py: munged, MariaDB, slurmdbd (accounting,
# so sacct answers), slurmctld and slurmd, all bound to 127.0.0.1, every file under $H2O_SLURM_DIR.
#
#   tests/slurm/up.sh          # (make slurm-up) install the packages if missing, start, wait for the node idle
#   export SLURM_CONF=/tmp/h2o-slurm/slurm.conf   # then sbatch, squeue, sacct, sinfo talk to it
#   tests/slurm/down.sh        # (make slurm-down) stop it
#
# Needs root (the daemons and the jobs run as root: SlurmUser=root) and either the Debian packages or apt-get.
# Idempotent: a cluster that answers already is left as it is. No systemd: the daemons are started directly.
# Exit status: 0 up, 3 cannot run here (not root, or packages missing and no apt-get or apt-get failing), 1 failed
# to come up (the daemons' log tails follow).
set -euo pipefail

S=${H2O_SLURM_DIR:-/tmp/h2o-slurm}
DB_PORT=${H2O_SLURM_DB_PORT:-3316}
CTLD_PORT=${H2O_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${H2O_SLURM_SLURMD_PORT:-6818}
DBD_PORT=${H2O_SLURM_DBD_PORT:-6819}
WAIT_S=${H2O_SLURM_WAIT_S:-90}
CPUS=4   # task slots, whatever cores this machine has (config_overrides): the tests' tasks mostly wait
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
BINARIES=(munged munge unmunge mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd
          sbatch sacct sacctmgr sinfo scontrol)
export SLURM_CONF=$S/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin
HOST=$(hostname -s)

say() { echo "slurm-up: $*" >&2; }
cannot() { say "cannot run here: $*"; exit 3; }
missing() { local b; for b in "${BINARIES[@]}"; do command -v "$b" >/dev/null || echo "$b"; done; }

[ "$(id -u)" = 0 ] || cannot "needs root (the daemons run as SlurmUser=root); on a shared machine ask for a cluster"

node_state() { timeout 5 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1 || true; }
if [ -e "$S/slurm.conf" ] && [ -z "$(missing)" ]; then
  case "$(node_state)" in
    idle|mixed|allocated|completing) say "already up ($S, node $HOST $(node_state))"; exit 0 ;;
  esac
fi

# ------------------------------------------------------------------ packages
if [ -n "$(missing)" ]; then
  command -v apt-get >/dev/null || cannot "Slurm packages missing ($(missing | tr '\n' ' ')) and no apt-get"
  say "installing ${PACKAGES[*]} with apt-get"
  # policy-rc.d 101: the packages' init scripts must not start the system's own daemons (we start ours below)
  own_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
  fi
  rc=0
  { apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; } \
    >"${TMPDIR:-/tmp}/h2o-slurm-apt.log" 2>&1 || rc=$?
  [ -n "$own_policy" ] && rm -f /usr/sbin/policy-rc.d
  [ $rc = 0 ] || { tail -20 "${TMPDIR:-/tmp}/h2o-slurm-apt.log" >&2; cannot "apt-get failed (status $rc, offline?)"; }
  [ -z "$(missing)" ] || { say "still missing after apt-get: $(missing | tr '\n' ' ')"; exit 1; }
fi

# ------------------------------------------------------------------ a fresh scratch folder
if [ -e "$S" ] && [ ! -e "$S/slurm.conf" ] && [ -n "$(ls -A "$S" 2>/dev/null)" ]; then
  say "H2O_SLURM_DIR=$S holds files but no slurm.conf: not a folder of this script; name a new or empty one"
  exit 1
fi
"$(dirname "$0")/down.sh" >/dev/null 2>&1 || true   # leftovers of an earlier cluster in $S
rm -rf "$S"
mkdir -p "$S"/{state,spool,db,log}
chmod 711 "$S"   # munged wants the folders of what it reads searchable

fail() {
  say "$1"
  for f in "$S"/log/*.log; do [ -s "$f" ] && { echo "--- $f" >&2; tail -8 "$f" >&2; }; done
  "$(dirname "$0")/down.sh" >/dev/null 2>&1 || true
  exit 1
}
wait_for() {  # wait_for <seconds> <what> <command...>
  local until=$((SECONDS + $1)) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $until ] || fail "timed out waiting for $what"
    sleep 0.5
  done
}

cat >"$S/slurm.conf" <<EOF
ClusterName=h2o
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the node as written here, whatever this machine has (memory is not a consumed resource with CR_CPU)
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=65536 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

cat >"$S/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=h2o
StorageLoc=slurm_acct_db
LogFile=$S/log/slurmdbd.log
PidFile=$S/slurmdbd.pid
EOF
chmod 600 "$S/slurmdbd.conf"

# ------------------------------------------------------------------ start
t0=$SECONDS
# munge on its default socket: Slurm 22.05's sacctmgr ignores AuthInfo=socket=... on its way to slurmdbd.
# A munged that answers there already (the machine's own) is used as it is; any key does, all daemons share it.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  dd if=/dev/urandom of="$S/munge.key" bs=1024 count=1 status=none
  chmod 400 "$S/munge.key"
  mkdir -p /run/munge
  munged --force --key-file="$S/munge.key" --pid-file="$S/munged.pid" --log-file="$S/log/munged.log" \
    --seed-file="$S/munged.seed" || fail "munged did not start"
fi

mariadb-install-db --no-defaults --datadir="$S/db" --user=root --auth-root-authentication-method=socket \
  --skip-test-db >"$S/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed"
setsid mariadbd --no-defaults --datadir="$S/db" --user=root --bind-address=127.0.0.1 --port="$DB_PORT" \
  --socket="$S/mysql.socket" --pid-file="$S/mariadbd.pid" --log-error="$S/log/mariadbd.log" \
  --innodb-buffer-pool-size=64M --skip-name-resolve </dev/null >/dev/null 2>&1 &
wait_for 60 "MariaDB" mariadb --no-defaults -S "$S/mysql.socket" -u root -e "SELECT 1"
mariadb --no-defaults -S "$S/mysql.socket" -u root -e \
  "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'h2o'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
  || fail "could not create the slurm database user"

slurmdbd || fail "slurmdbd did not start"
wait_for 60 "slurmdbd" sacctmgr -n list cluster
sacctmgr -i add cluster h2o >/dev/null || fail "sacctmgr add cluster failed"
slurmctld || fail "slurmctld did not start"
slurmd || fail "slurmd did not start"
until=$((SECONDS + WAIT_S))
until [ "$(node_state)" = idle ]; do
  [ $SECONDS -lt $until ] || fail "node $HOST not idle after ${WAIT_S} s (sinfo: '$(node_state)')"
  sleep 0.5
done
say "up in $((SECONDS - t0)) s: node $HOST idle ($CPUS CPUs), $(sinfo -V); export SLURM_CONF=$S/slurm.conf"
