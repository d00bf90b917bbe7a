#!/usr/bin/env bash
# Start a one-node Slurm cluster with job accounting on this machine, for
# tests/test_slurm.py (and CI). Needs root; tests/slurm/stop-local-slurm.sh stops it.
#
# Idempotent: installs Debian's slurm-wlm (slurmctld, slurmd, client commands), slurmdbd,
# mariadb-server and munge with apt-get when a command is missing; writes
# /etc/slurm/{slurm,gres,slurmdbd}.conf (never replacing files it did not write); starts
# munged, a private mariadbd (data in $STATE/mysql, 127.0.0.1:3307, no grant tables: a
# throwaway database reachable only from this machine), slurmdbd, slurmctld and slurmd
# directly (no systemd), each only if not already running; and waits until `sinfo` shows
# the node idle. A changed configuration restarts the Slurm daemons.
#
# The single node is `hostname -s` at 127.0.0.1 with the CPUs and memory `slurmd -C`
# detects, in partition `debug` (the default), and EAGLE3_SLURM_FAKE_GPUS (default 2) `gpu`
# generic resources of type `fake` backed by fake device files ($STATE/dev/fake-gpuN,
# character devices like /dev/null). No GPU is behind them: Slurm grants `--gpus=N` and
# `--gpus=fake:N` up to that count and sets CUDA_VISIBLE_DEVICES in the job, and that is all
# a job sees of "its" GPU. Account `eagle3` is the default account of the calling user.
set -euo pipefail
export PATH=/usr/sbin:/sbin:$PATH  # the daemons live in sbin

STATE=${EAGLE3_SLURM_STATE:-/var/tmp/eagle3-slurm}
FAKE_GPUS=${EAGLE3_SLURM_FAKE_GPUS:-2}
TIMEOUT=${EAGLE3_SLURM_START_TIMEOUT:-120}
MARK="# written by eagle3-pipeline tests/slurm/start-local-slurm.sh"
CLUSTER=eagle3test
ACCOUNT=eagle3

die() { echo "start-local-slurm: $*" >&2; exit 1; }
log() { echo "start-local-slurm: $*"; }
# alive PIDFILE: the process named in PIDFILE runs and is the daemon the file is named after
# (a pid left from before a reboot may belong to something else by now)
alive() { [[ -f $1 && "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" == "$(basename "$1" .pid)" ]]; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local n=$1 what=$2; shift 2
  for ((k = 0; k < n * 5; k++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up within ${n}s (logs in $STATE/log)"
}

[[ $(id -u) == 0 ]] || die "needs root (installs packages, starts daemons)"

# 1. packages
missing=0
for c in slurmctld slurmd slurmdbd sinfo sbatch srun sacct sacctmgr scontrol munged munge mariadbd mariadb-install-db; do
  command -v "$c" >/dev/null || missing=1
done
if ((missing)); then
  command -v apt-get >/dev/null || die "Slurm, MariaDB or munge is missing and there is no apt-get to install them"
  log "installing slurm-wlm, slurmdbd, mariadb-server and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # keep the packages' scripts from starting system-wide daemons (this script starts its own)
  policy=/usr/sbin/policy-rc.d
  made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  mkdir -p "$STATE/log"
  if ! { apt-get update -q && apt-get install -y -q --no-install-recommends slurm-wlm slurmdbd mariadb-server munge; } \
    >"$STATE/log/apt-get.log" 2>&1; then
    tail -n 30 "$STATE/log/apt-get.log" >&2
    if ((made_policy)); then rm -f "$policy"; fi
    die "apt-get failed (whole output in $STATE/log/apt-get.log)"
  fi
  if ((made_policy)); then rm -f "$policy"; fi
fi

# 2. configuration
for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/slurmdbd.conf; do
  if [[ -e $f ]] && ! head -1 "$f" | grep -qxF "$MARK"; then
    die "$f exists and was not written by this script; refusing to replace it"
  fi
done
node=$(hostname -s)
# the node's hardware as slurmd detects it, so slurmctld never drains it for a mismatch
hw=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //')
mkdir -p "$STATE"/{ctld,spool,dev,log,run,mysql} /etc/slurm
chown mysql:mysql "$STATE/mysql"
for ((i = 0; i < FAKE_GPUS; i++)); do
  [[ -c $STATE/dev/fake-gpu$i ]] || mknod "$STATE/dev/fake-gpu$i" c 1 3
done
slurm_conf="$MARK
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu,gres/gpu:fake
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 $hw Gres=gpu:fake:$FAKE_GPUS State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP"
gres_conf="$MARK
AutoDetect=off
NodeName=$node Name=gpu Type=fake File=$STATE/dev/fake-gpu[0-$((FAKE_GPUS - 1))]"
dbd_conf="$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StorageLoc=slurm_acct_db
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log"
changed=0
write_if_changed() {  # write_if_changed FILE CONTENT
  if [[ ! -f $1 || "$(cat "$1")" != "$2" ]]; then
    printf '%s\n' "$2" >"$1"
    changed=1
  fi
}
write_if_changed /etc/slurm/slurm.conf "$slurm_conf"
write_if_changed /etc/slurm/gres.conf "$gres_conf"
write_if_changed /etc/slurm/slurmdbd.conf "$dbd_conf"
chmod 600 /etc/slurm/slurmdbd.conf

# 3. munge (runs as its own user; the package makes the key, or it is made here)
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if [[ ! -s /etc/munge/munge.key ]]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge_ok; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged munge_ok
  cp /run/munge/munged.pid "$STATE/run/munged.pid"  # ours to stop (a munged found running is not)
fi

# 4. the accounting database and slurmdbd
if ((changed)); then
  for p in slurmd slurmctld slurmdbd; do
    if alive "$STATE/run/$p.pid"; then
      log "configuration changed; stopping $p"
      kill "$(cat "$STATE/run/$p.pid")"
      for _ in $(seq 100); do alive "$STATE/run/$p.pid" || break; sleep 0.2; done
    fi
  done
fi
db_ok() { mariadb --no-defaults -h 127.0.0.1 -P 3307 -u slurm -e 'select 1'; }
if ! alive "$STATE/mysql/mariadbd.pid"; then
  [[ -d $STATE/mysql/mysql ]] || mariadb-install-db --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --auth-root-authentication-method=socket --skip-test-db >"$STATE/log/mariadb-install-db.log" 2>&1
  log "starting mariadbd"
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --socket="$STATE/mysql/mysqld.sock" --pid-file="$STATE/mysql/mariadbd.pid" \
    --bind-address=127.0.0.1 --port=3307 --skip-grant-tables \
    --log-error="$STATE/mysql/error.log" </dev/null >/dev/null 2>&1 &
  wait_for 60 mariadbd db_ok
fi
if ! alive "$STATE/run/slurmdbd.pid"; then
  log "starting slurmdbd"
  /usr/sbin/slurmdbd
  wait_for 60 slurmdbd sacctmgr -n list cluster
fi
user=$(id -un)
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT" || sacctmgr -i add account "$ACCOUNT" \
  cluster="$CLUSTER" description=eagle3-pipeline-tests organization=eagle3-pipeline >/dev/null
sacctmgr -n -P list user "$user" format=defaultaccount | grep -qx "$ACCOUNT" ||
  sacctmgr -i add user "$user" account="$ACCOUNT" defaultaccount="$ACCOUNT" >/dev/null

# 5. slurmctld and slurmd
if ! alive "$STATE/run/slurmctld.pid"; then
  log "starting slurmctld"
  /usr/sbin/slurmctld -i  # -i: ignore state files of an earlier configuration
fi
if ! alive "$STATE/run/slurmd.pid"; then
  log "starting slurmd"
  /usr/sbin/slurmd
fi

# 6. wait for the node
state=""
for ((t = 0; t < TIMEOUT; t++)); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  case $state in
    idle | mixed | allocated) break ;;
    down* | drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
case $state in
  idle | mixed | allocated) ;;
  *)
    tail -n 20 "$STATE"/log/*.log >&2 || true
    die "node $node is '$state' after ${TIMEOUT}s (logs in $STATE/log)"
    ;;
esac
log "node $node is $state: $(sinfo -h -N -o '%N: %c CPUs, %m MB, %G')"
