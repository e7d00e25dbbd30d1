/* xxh.h — XXH3 as the library computes it. Where the installed libxxhash has
 * its x86 run-time dispatch (CMake found XXH3_64bits_update_dispatch:
 * CKPT_HAVE_XXH_DISPATCH), the XXH3 calls of every file that includes this
 * header go through it, so they use the widest vector unit the CPU has
 * (AVX2 where present, about twice as fast as the SSE2 code a portable build
 * runs); otherwise they are the portable ones. The digests are the same.
 * One XXH3 streaming state gives both digests of its bytes: the 64-bit
 * (XXH3_64bits_digest) and the 128-bit one (XXH3_128bits_digest); libxxhash
 * resets and updates both kinds alike (unit.test_io checks that it still
 * does). */
#ifndef CKPT_XXH_H
#define CKPT_XXH_H

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#ifdef CKPT_HAVE_XXH_DISPATCH
#include <xxh_x86dispatch.h>
#endif

#endif
