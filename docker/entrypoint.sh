#!/bin/sh
# The image's entry point: every argument goes to the lattica CLI, so `docker run IMAGE --help`
# and `docker run IMAGE join ...` work, and so does `docker run IMAGE lattica --help`.
if [ "${1:-}" = "lattica" ]; then
    shift
fi
exec lattica "$@"
