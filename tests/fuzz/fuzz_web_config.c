/* libFuzzer target: the metrics endpoint's web configuration file (YAML),
 * parsed without reading the files it names. Whatever the bytes: an error
 * with a message, or a configuration whose users are all usable. */
#include <stdint.h>
#include <string.h>

#include "ops/web_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    outbox__web_config *w = NULL;
    char err[512];
    int e;
    err[0] = '\0';
    e = outbox__web_config_parse(&w, (const char *)data, size, "fuzz.yml", "/etc", err, sizeof err);
    if (e != 0 && (!err[0] || w))
        __builtin_trap();
    if (e == 0) {
        for (size_t i = 0; i < w->nusers; i++)
            if (!w->users[i].name_len || strchr(w->users[i].name, ':') || strlen(w->users[i].hash) != 60 ||
                outbox__web_config_user(w, w->users[i].name, w->users[i].name_len) == NULL)
                __builtin_trap();
        if (w->nusers && strlen(w->decoy) != 29)
            __builtin_trap();
        outbox__web_config_free(w);
    }
    return 0;
}
