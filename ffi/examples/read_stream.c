/* A trainer rank in C: open a stream, read every sample in place, print what it holds.
 *
 *   read_stream SOCKET STREAM RECORDS SEED WORLD EPOCHS RANK
 *
 * Build: cargo build -p feedstore-ffi, then
 *   gcc -I ffi/include ffi/examples/read_stream.c target/debug/libfeedstore_c.a -lpthread -ldl -lm
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "feedstore.h"

static int fail(const char *what) {
    fprintf(stderr, "error: %s: %s\n", what, fs_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s SOCKET STREAM RECORDS SEED WORLD EPOCHS RANK\n", argv[0]);
        return 2;
    }
    FsStreamSpec spec = {
        .name = argv[2],
        .records = strtoull(argv[3], NULL, 10),
        .seed = strtoull(argv[4], NULL, 10),
        .world = (uint32_t)strtoul(argv[5], NULL, 10),
        .shuffle = 1, /* a full permutation per epoch */
        .block = 0,
        .tail = 0, /* drop the uneven tail */
        .epochs = strtoull(argv[6], NULL, 10),
    };
    uint32_t rank = (uint32_t)strtoul(argv[7], NULL, 10);

    /* The library linked must be the release the header came from. */
    char header[32];
    snprintf(header, sizeof header, "%d.%d.%d", FEEDSTORE_VERSION_MAJOR,
             FEEDSTORE_VERSION_MINOR, FEEDSTORE_VERSION_PATCH);
    if (strcmp(header, fs_version()) != 0) {
        fprintf(stderr, "error: feedstore.h is %s, the library %s\n", header, fs_version());
        return 2;
    }
    printf("feedstore %s\n", fs_version());

    FsStream *stream = NULL;
    if (fs_stream_open(argv[1], &spec, rank, NULL, 0, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open");
    }
    FsSample *sample = NULL;
    FsStatus status;
    while ((status = fs_stream_next(stream, &sample)) == FS_STATUS_OK) {
        const char *id;
        size_t id_len, images, n_tokens;
        const uint32_t *tokens;
        FsTensor image;
        if (fs_sample_id(sample, &id, &id_len) != FS_STATUS_OK ||
            fs_sample_tokens(sample, &tokens, &n_tokens) != FS_STATUS_OK ||
            fs_sample_image_count(sample, &images) != FS_STATUS_OK) {
            return fail("reading a sample");
        }
        printf("sample seq=%" PRIu64 " record=%" PRIu64 " id=%.*s tokens=%zu first=%u",
               fs_sample_seq(sample), fs_sample_record(sample), (int)id_len, id, n_tokens,
               n_tokens > 0 ? tokens[0] : 0);
        for (size_t i = 0; i < images; i++) {
            if (fs_sample_image(sample, i, &image) != FS_STATUS_OK) {
                return fail("fs_sample_image");
            }
            printf(" image=");
            for (size_t d = 0; d < image.ndim; d++) {
                printf(d ? "x%zu" : "%zu", image.shape[d]);
            }
            printf(" dtype=%u pixel0=%u", image.dtype,
                   image.dtype == 0 ? ((const uint8_t *)image.data)[0] : 0u);
        }
        printf("\n");
        fs_sample_free(sample); /* returns it to the stream */
    }
    if (status != FS_STATUS_END) {
        return fail("fs_stream_next");
    }
    char state[64];
    if (fs_stream_state(stream, state, sizeof state) != FS_STATUS_OK) {
        return fail("fs_stream_state");
    }
    printf("state=%s\nend\n", state);
    fs_stream_free(stream);
    return 0;
}
