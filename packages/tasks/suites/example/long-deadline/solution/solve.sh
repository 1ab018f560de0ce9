#!/bin/bash
set -euo pipefail
python3 - <<'PY' > primes.txt
primes = []
n = 2
while len(primes) < 25:
    if all(n % p for p in primes if p * p <= n):
        primes.append(n)
    n += 1
print("\n".join(map(str, primes)))
PY
