// The cost of an r-row forward in llama.cpp as speculative verification needs it: r new tokens after a
// prompt of DEPTH tokens, with logits for every row (llama-bench's `-p r -d DEPTH` times a prompt batch,
// which computes logits for its last row only, so the head is read once whatever r is). Prints one JSON
// object: for each r, the median milliseconds with logits for all rows ("all") and for the last ("last").
// Built and run by scripts/side_by_side_quant.py against the static libs of the kit's llama.cpp build.
// usage: llama_rows MODEL.gguf THREADS DEPTH ROWS[,ROWS...] REPS
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

// Decode `n` tokens at positions `pos..pos+n` of sequence 0; logits for every row or the last only.
static double timed_decode(llama_context * ctx, int pos, int n, bool all_logits) {
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = 100 + i;
        b.pos[i] = pos + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = all_logits || i + 1 == n;
    }
    b.n_tokens = n;
    auto t = std::chrono::steady_clock::now();
    int rc = llama_decode(ctx, b);
    llama_synchronize(ctx);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
    llama_batch_free(b);
    if (rc != 0) { fprintf(stderr, "decode failed (%d)\n", rc); exit(1); }
    return ms;
}

int main(int argc, char ** argv) {
    if (argc != 6) { fprintf(stderr, "usage: %s MODEL.gguf THREADS DEPTH ROWS[,ROWS...] REPS\n", argv[0]); return 2; }
    const int threads = atoi(argv[2]), depth = atoi(argv[3]), reps = atoi(argv[5]);
    std::vector<int> rows;
    for (char * p = strtok(argv[4], ","); p; p = strtok(nullptr, ",")) rows.push_back(atoi(p));
    if (threads < 1 || depth < 1 || reps < 1 || rows.empty()) return 2;

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.swa_full = true;  // as speculative decoding runs it: rolled-back positions must stay in the window
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }

    timed_decode(ctx, 0, depth, false);
    llama_memory_t mem = llama_get_memory(ctx);
    printf("{");
    for (int mode = 0; mode < 2; mode++) {
        printf("%s\"%s\": {", mode ? ", " : "", mode == 0 ? "all" : "last");
        for (size_t j = 0; j < rows.size(); j++) {
            std::vector<double> ms;
            for (int r = 0; r < reps + 1; r++) {  // the first is a warm-up
                double t = timed_decode(ctx, depth, rows[j], mode == 0);
                if (!llama_memory_seq_rm(mem, 0, depth, -1)) { fprintf(stderr, "rollback failed\n"); return 1; }
                if (r > 0) ms.push_back(t);
            }
            std::sort(ms.begin(), ms.end());
            printf("%s\"%d\": %.4f", j ? ", " : "", rows[j], ms[ms.size() / 2]);
        }
        printf("}");
    }
    printf("}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
