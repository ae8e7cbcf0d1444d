#!/bin/sh
# One-time set-up of this folder before `docker compose up`:
#  - cluster-token: the secret every internal gRPC call carries (made if absent).
#    Compose mounts a file secret as it is on the host (its uid/mode options
#    apply to Swarm only), and the containers run as uid 10001: the file must
#    be readable by that uid. As root: owned by 10001, mode 0400; otherwise
#    mode 0644 (readable by other users of this host: `sudo ./init.sh` once,
#    or `sudo chown 10001 cluster-token && sudo chmod 400 cluster-token`);
#  - .env: copied from .env.example if absent, and given an API key when
#    FERRY_API_KEY is empty (the frontend refuses to start without one).
# Safe to run again: it never replaces what is already there.
set -eu
cd "$(dirname "$0")"

random() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import secrets; print(secrets.token_urlsafe(32))'
    else
        head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'
        echo
    fi
}

FERRY_UID="${FERRY_UID:-10001}"   # the images' user (deploy/docker/Dockerfile*)
if [ ! -s cluster-token ]; then
    (umask 077 && random > cluster-token)
    echo "init: wrote cluster-token"
fi
if [ "$(id -u)" = 0 ]; then
    chown "$FERRY_UID:$FERRY_UID" cluster-token && chmod 0400 cluster-token
else
    chmod 0644 cluster-token
fi

[ -f .env ] || cp .env.example .env
if ! grep -Eq '^FERRY_API_KEY=.+' .env; then
    key="sk-ferry-$(random)"
    if grep -Eq '^FERRY_API_KEY=' .env; then
        sed -i.bak "s|^FERRY_API_KEY=.*|FERRY_API_KEY=${key}|" .env && rm -f .env.bak
    else
        printf 'FERRY_API_KEY=%s\n' "$key" >> .env
    fi
    chmod 600 .env
    echo "init: generated an API key into .env (FERRY_API_KEY): ${key}"
fi
