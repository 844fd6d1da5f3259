/*
 * For the tools: src/store/figures.h, the outbox table's figures without a
 * pass over its rows. outbox-replay stats prints them and outbox-bench
 * times them, so both read exactly what /metrics and /healthz report.
 */
#include "../../store/figures.h"
