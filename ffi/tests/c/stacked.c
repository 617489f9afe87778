/* A trainer rank in C reading whole batches: after SKIP single samples, N samples at a time,
 * and image 0 of each batch as one stacked tensor when the producer placed the batch in one
 * object.
 *
 *   stacked SOCKET STREAM RECORDS N SKIP
 *
 * Prints, per batch: its first sequence number, whether it came as one view, its shape, and
 * the first byte of each image (from the stacked view, or from each sample when it did not).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "feedstore.h"

static int fail(const char *what) {
    fprintf(stderr, "error: %s: %s\n", what, fs_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SOCKET STREAM RECORDS N SKIP\n", argv[0]);
        return 2;
    }
    FsStreamSpec spec = {
        .name = argv[2],
        .records = strtoull(argv[3], NULL, 10),
        .seed = 0,
        .world = 1,
        .shuffle = 0,
        .block = 0,
        .tail = 0,
        .epochs = 1,
    };
    size_t n = strtoul(argv[4], NULL, 10), skip = strtoul(argv[5], NULL, 10);
    FsStream *stream = NULL;
    if (fs_stream_open(argv[1], &spec, 0, NULL, 0, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open");
    }
    FsSample *batch[64];
    if (n == 0 || n > 64) {
        return 2;
    }
    for (size_t i = 0; i < skip; i++) {
        if (fs_stream_next(stream, &batch[0]) != FS_STATUS_OK) {
            return fail("fs_stream_next");
        }
        fs_sample_free(batch[0]);
    }
    for (;;) {
        size_t got = 0;
        FsStatus status = FS_STATUS_OK;
        while (got < n && (status = fs_stream_next(stream, &batch[got])) == FS_STATUS_OK) {
            got++;
        }
        if (status != FS_STATUS_OK && status != FS_STATUS_END) {
            return fail("fs_stream_next");
        }
        if (got == 0) {
            break;
        }
        FsTensor stacked;
        if (fs_stacked_image((const FsSample *const *)batch, got, 0, &stacked) != FS_STATUS_OK) {
            return fail("fs_stacked_image");
        }
        printf("batch seq=%" PRIu64 " view=%d shape=", fs_sample_seq(batch[0]),
               stacked.data != NULL);
        for (size_t d = 0; d < stacked.ndim; d++) {
            printf(d ? "x%zu" : "%zu", stacked.shape[d]);
        }
        printf(" first=");
        for (size_t i = 0; i < got; i++) {
            unsigned first;
            if (stacked.data != NULL) {
                first = ((const uint8_t *)stacked.data)[i * (stacked.bytes / got)];
            } else {
                FsTensor image;
                if (fs_sample_image(batch[i], 0, &image) != FS_STATUS_OK) {
                    return fail("fs_sample_image");
                }
                first = ((const uint8_t *)image.data)[0];
            }
            printf(i ? ",%u" : "%u", first);
        }
        printf("\n");
        for (size_t i = 0; i < got; i++) {
            fs_sample_free(batch[i]);
        }
        if (status == FS_STATUS_END) {
            break;
        }
    }
    fs_stream_free(stream);
    printf("end\n");
    return 0;
}
