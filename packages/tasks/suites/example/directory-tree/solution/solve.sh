#!/bin/bash
set -euo pipefail
for file in inbox/*.*; do
  name=$(basename "$file")
  ext=${name##*.}
  mkdir -p "sorted/$ext"
  mv "$file" "sorted/$ext/$name"
done
