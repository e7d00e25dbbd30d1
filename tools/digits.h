/* digits.h — the demo's data set: UCI handwritten digits, 8x8 pixels 0..16. */
#ifndef CKPT_TOOLS_DIGITS_H
#define CKPT_TOOLS_DIGITS_H

#include <stddef.h>
#include <stdint.h>

#define DIGITS_PIXELS 64
#define DIGITS_CLASSES 10

/* One sample as the data loader hands it out: pixels scaled to [0,1]. */
typedef struct digits_sample {
    float x[DIGITS_PIXELS];
    int32_t label;
} digits_sample;

/* Parses one CSV row "p0,...,p63,label" (pixels 0..16, label 0..9).
 * Returns 0, or -1 with a reason in err. */
int digits_parse_line(const char *line, digits_sample *s, char *err, size_t errcap);

/* Reads every row of a CSV file, gzip-compressed or plain. *out is malloc'd.
 * Returns 0, or -1 with "path:line: reason" in err. */
int digits_load(const char *path, digits_sample **out, int64_t *n, char *err, size_t errcap);

#endif
