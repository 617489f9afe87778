/* Resuming from C at another world size: the old run's states resharded for this rank
 * (fs_reshard), the stream opened from the result, read to its end, and its state saved.
 *
 *   reshard SOCKET STREAM RECORDS SEED EPOCHS WORLD RANK STATE...
 *
 * The spec is shuffled in full, dropping the uneven tail; WORLD is the new run's, the STATEs
 * every rank's of the old run. Prints "seq record" per sample, then "state TEXT" after the
 * last, and a state opened again from that text says the stream has ended.
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
    if (argc < 9) {
        fprintf(stderr, "usage: %s SOCKET STREAM RECORDS SEED EPOCHS WORLD RANK STATE...\n",
                argv[0]);
        return 2;
    }
    FsStreamSpec spec = {
        .name = argv[2],
        .records = strtoull(argv[3], NULL, 10),
        .seed = strtoull(argv[4], NULL, 10),
        .world = (uint32_t)strtoul(argv[6], NULL, 10),
        .shuffle = 1,
        .block = 0,
        .tail = 0,
        .epochs = strtoull(argv[5], NULL, 10),
    };
    uint32_t rank = (uint32_t)strtoul(argv[7], NULL, 10);
    static char state[FS_STATE_BYTES];
    if (fs_reshard(&spec, (const char *const *)&argv[8], (size_t)(argc - 8), rank, state,
                   sizeof state) != FS_STATUS_OK) {
        return fail("fs_reshard");
    }
    FsStream *stream = NULL;
    if (fs_stream_open(argv[1], &spec, rank, state, 30000, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open");
    }
    FsSample *sample = NULL;
    FsStatus status;
    while ((status = fs_stream_next(stream, &sample)) == FS_STATUS_OK) {
        printf("%" PRIu64 " %" PRIu64 "\n", fs_sample_seq(sample), fs_sample_record(sample));
        fs_sample_free(sample);
    }
    if (status != FS_STATUS_END) {
        return fail("fs_stream_next");
    }
    if (fs_stream_state(stream, state, sizeof state) != FS_STATUS_OK) {
        return fail("fs_stream_state");
    }
    printf("state %s\n", state);
    fs_stream_free(stream);
    /* The saved state resumes at the end: nothing more. */
    if (fs_stream_open(argv[1], &spec, rank, state, 30000, &stream) != FS_STATUS_OK) {
        return fail("fs_stream_open from the saved state");
    }
    if (fs_stream_next(stream, &sample) != FS_STATUS_END) {
        fprintf(stderr, "error: a sample past the end\n");
        return 1;
    }
    fs_stream_free(stream);
    return 0;
}
