#!/bin/bash
set -euo pipefail
printf 'Hello, fleet!\n' > hello.txt
