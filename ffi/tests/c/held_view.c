/* Issue 11 from C: a sample kept while its stream is freed and reopened at a later position,
 * and while other work fills the store, still reads its own bytes.
 *
 *   held_view SOCKET STREAM RECORDS
 *
 * Keeps sample 0 (its image pointer and token pointer), reads and frees samples 1 and 2, frees
 * the stream, reopens it from its state, says READY and waits for a line on stdin (the test
 * refills the store meanwhile), then checks every byte the held pointers see.
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
    if (argc != 4) {
        fprintf(stderr, "usage: %s SOCKET STREAM RECORDS\n", argv[0]);
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
    FsStream *stream = NULL;
    if (fs_stream_open(argv[1], &spec, 0, NULL, 0, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open");
    }
    FsSample *held = NULL, *other = NULL;
    if (fs_stream_next(stream, &held) != FS_STATUS_OK) {
        return fail("fs_stream_next");
    }
    FsTensor image;
    const uint32_t *tokens;
    size_t n_tokens;
    if (fs_sample_image(held, 0, &image) != FS_STATUS_OK ||
        fs_sample_tokens(held, &tokens, &n_tokens) != FS_STATUS_OK) {
        return fail("reading sample 0");
    }
    uint64_t record = fs_sample_record(held);
    for (int i = 0; i < 2; i++) {
        if (fs_stream_next(stream, &other) != FS_STATUS_OK) {
            return fail("fs_stream_next");
        }
        fs_sample_free(other);
    }
    char state[64];
    if (fs_stream_state(stream, state, sizeof state) != FS_STATUS_OK) {
        return fail("fs_stream_state");
    }
    fs_stream_free(stream); /* the stream goes; the sample stays */
    if (fs_stream_open(argv[1], &spec, 0, state, 0, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open from the state");
    }
    printf("READY\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) {
        return fail("waiting for the refill");
    }
    size_t bad = 0;
    const uint8_t *pixels = image.data;
    for (size_t i = 0; i < image.bytes; i++) {
        bad += pixels[i] != (uint8_t)(record + 1);
    }
    for (size_t i = 0; i < n_tokens; i++) {
        bad += tokens[i] != 1000 + record + i;
    }
    printf("held record=%" PRIu64 " bytes=%zu tokens=%zu wrong=%zu\n", record, image.bytes,
           n_tokens, bad);
    FsSample *next = NULL;
    if (fs_stream_next(stream, &next) != FS_STATUS_OK) {
        return fail("fs_stream_next after the reopen");
    }
    printf("next seq=%" PRIu64 "\n", fs_sample_seq(next));
    fs_sample_free(next);
    fs_sample_free(held);
    fs_stream_free(stream);
    return 0;
}
