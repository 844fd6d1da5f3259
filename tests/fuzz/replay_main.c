/* A driver for the fuzz targets outside libFuzzer: runs every file in the
 * directories (or files) named on the command line through the target once.
 * The regular test suite uses it to replay the seed corpus and every input
 * that once crashed (tests/fuzz/regressions/). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    /* An exact-size heap copy: any over-read shows under ASan/valgrind. */
    buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int count = 0, failed = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0)
            continue; /* an absent regression folder is fine */
        if (S_ISDIR(st.st_mode)) {
            DIR *d = opendir(argv[i]);
            struct dirent *de;
            while (d && (de = readdir(d)) != NULL) {
                char path[4096];
                if (de->d_name[0] == '.')
                    continue;
                snprintf(path, sizeof path, "%s/%s", argv[i], de->d_name);
                if (run_file(path) != 0)
                    failed++;
                count++;
            }
            if (d)
                closedir(d);
        } else {
            if (run_file(argv[i]) != 0)
                failed++;
            count++;
        }
    }
    printf("1..1\n%s 1 - replayed %d inputs\n", failed || count == 0 ? "not ok" : "ok", count);
    return failed || count == 0;
}
