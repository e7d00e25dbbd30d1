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
/* The dispatch entry points are referenced weakly: Debian's libxxhash.so has
 * them but its libxxhash.a does not, so a fully static program (pkg-config
 * --static) links with them absent (null) and gets the portable calls, and
 * every other program the dispatching ones. */
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#pragma weak XXH3_64bits_dispatch
#pragma weak XXH3_64bits_update_dispatch
#pragma weak XXH3_128bits_dispatch

static inline XXH64_hash_t ckpt__xxh3_64bits(const void *p, size_t n) {
    return XXH3_64bits_dispatch ? XXH3_64bits_dispatch(p, n) : XXH3_64bits(p, n);
}
static inline XXH_errorcode ckpt__xxh3_64bits_update(XXH3_state_t *s, const void *p, size_t n) {
    return XXH3_64bits_update_dispatch ? XXH3_64bits_update_dispatch(s, p, n)
                                       : XXH3_64bits_update(s, p, n);
}
static inline XXH128_hash_t ckpt__xxh3_128bits(const void *p, size_t n) {
    return XXH3_128bits_dispatch ? XXH3_128bits_dispatch(p, n) : XXH3_128bits(p, n);
}
#define XXH3_64bits ckpt__xxh3_64bits
#define XXH3_64bits_update ckpt__xxh3_64bits_update
#define XXH3_128bits ckpt__xxh3_128bits
#endif

#endif
