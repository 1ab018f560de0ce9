#!/bin/bash
echo "running the nightly job"
