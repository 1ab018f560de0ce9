#!/bin/bash
set -euo pipefail
awk '
  /^\[/ { section = $0 }
  section == "[server]" && /^port[[:space:]]*=/ { $0 = "port = 9090" }
  section == "[server]" && /^debug[[:space:]]*=/ { $0 = "debug = false" }
  { print }
' app.conf > /tmp/app.conf.new
cat /tmp/app.conf.new > app.conf
rm -f /tmp/app.conf.new
