#!/usr/bin/env bash
# test_kill_resume.sh with every save asynchronous (ckpt train --async): kill -9
# at random moments and while the background thread writes a file of the
# checkpoint; the resumed runs still end bit for bit where an uninterrupted
# run ends. Fewer kills than the synchronous suite, to keep the suite short.
CKPT_KILL_ASYNC=1 CKPT_KILLS=${CKPT_KILLS:-6} exec bash "$(dirname "$0")/test_kill_resume.sh"
