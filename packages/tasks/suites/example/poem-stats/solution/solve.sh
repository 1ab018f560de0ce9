#!/bin/bash
set -euo pipefail
longest=$(tr -cs '[:alpha:]' '\n' < poem.txt | awk 'length > length(best) { best = $0 } END { print best }')
{
  echo "LINES=$(wc -l < poem.txt)"
  echo "WORDS=$(wc -w < poem.txt)"
  echo "BYTES=$(wc -c < poem.txt)"
  echo "LONGEST=$longest"
} > stats.env
