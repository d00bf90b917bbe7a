#!/usr/bin/env bash
# Stop the daemons tests/slurm/start-local-slurm.sh started, by the pid files it keeps, in
# reverse order (a munged that it found running is left alone). Packages, configuration and
# the accounting database stay; start-local-slurm.sh brings the cluster back.
set -uo pipefail
STATE=${EAGLE3_SLURM_STATE:-/var/tmp/eagle3-slurm}
for pidfile in "$STATE"/run/{slurmd,slurmctld,slurmdbd}.pid "$STATE"/mysql/mariadbd.pid "$STATE"/run/munged.pid; do
  [[ -f $pidfile ]] || continue
  pid=$(cat "$pidfile")
  # only the daemon the file is named after (a stale pid may belong to another process by now)
  if [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$(basename "$pidfile" .pid)" ]]; then
    echo "stop-local-slurm: stopping $(basename "$pidfile" .pid) (pid $pid)"
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
done
exit 0
