#!/usr/bin/env bash
# test_kill_resume.sh with the first two layers frozen (ckpt train --freeze):
# every save after the first links the frozen file of the checkpoint before
# it instead of writing it; kill -9 at random moments and as a save starts
# (while it links); the resumed runs still end bit for bit where an
# uninterrupted run ends. Fewer kills than the plain suite.
CKPT_KILL_FREEZE=1 CKPT_KILLS=${CKPT_KILLS:-5} exec bash "$(dirname "$0")/test_kill_resume.sh"
