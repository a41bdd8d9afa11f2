#!/usr/bin/env bash
# Installs the system components the test suite runs for real: Open MPI, SLURM + munge, Lmod,
# and iproute2 for the test SLURM cluster's hosts (network namespaces joined by a bridge).
# Debian packages only; idempotent (skips what is already installed). Needs root or sudo.
set -euo pipefail
packages=(openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge lmod iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing Debian packages: ${missing[*]}"
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
