/* base64.h — standard base64 (RFC 4648, with '=' padding) for byte entries
 * kept in a JSON document. */
#ifndef CKPT_BASE64_H
#define CKPT_BASE64_H

#include <stddef.h>
#include <stdint.h>

/* Encodes n bytes into a NUL-terminated malloc'd string (ckpt__malloc).
 * CKPT_ENOMEM or CKPT_EINVAL (too large). */
int ckpt__base64_encode(const void *p, size_t n, char **out);
/* Decodes strictly: length a multiple of 4, only the standard alphabet,
 * padding only at the end, unused bits zero. *out is malloc'd (at least one
 * byte even when *n is 0). CKPT_ECORRUPT with a message on bad input (no
 * file name: the caller prefixes it). */
int ckpt__base64_decode(const char *s, size_t len, uint8_t **out, size_t *n);

#endif
