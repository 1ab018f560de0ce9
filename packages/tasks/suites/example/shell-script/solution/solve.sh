#!/bin/bash
set -euo pipefail
cat > greet.sh <<'SH'
#!/bin/bash
if [ "$#" -lt 1 ]; then
  echo "usage: greet.sh NAME" >&2
  exit 2
fi
echo "Hello, $1!"
SH
chmod +x greet.sh
