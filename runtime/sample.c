// --sample N: after training (or from a checkpoint), N tokens generated after --prompt by
// repeated forwards of the model, printed by rank 0 as text (a byte model) or token ids.
// rt_trainer.h.
#include "rt_trainer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The prompt as tokens: its bytes for a byte model (vocab <= 256), otherwise token ids
// separated by spaces. Fails on a token the vocabulary lacks, and on no token at all.
static int tokens_of(const RtModel *m, const char *prompt, int32_t *out, int64_t *n) {
  *n = 0;
  if (m->vocab <= 256) {
    for (const unsigned char *c = (const unsigned char *)prompt; *c; c++) {
      if (*c >= m->vocab)
        return rt_fail("--prompt: byte %d at offset %lld is not below vocab %lld", *c, (long long)*n,
                       (long long)m->vocab);
      out[(*n)++] = *c;
    }
    return 0;
  }
  for (const char *c = prompt; *c;) {
    char *end;
    long long t = strtoll(c, &end, 10);
    if (end == c)
      return rt_fail("--prompt of a model with vocab %lld is token ids separated by spaces, not '%s'",
                     (long long)m->vocab, prompt);
    if (t < 0 || t >= m->vocab)
      return rt_fail("--prompt: token %lld is not below vocab %lld", t, (long long)m->vocab);
    out[(*n)++] = (int32_t)t;
    for (c = end; *c == ' '; c++) {}
  }
  return 0;
}

static int prompt_tokens(const RtModel *m, const char *prompt, int32_t *out, int64_t *n) {
  int status = tokens_of(m, prompt, out, n);
  if (status == 0 && *n == 0)
    status = rt_fail("--prompt is empty: the sample needs at least one token to continue");
  return status;
}

int rt_prompt_check(const RtModel *m, const RtOptions *o) {
  if (o->prompt && o->sample <= 0)
    return rt_fail("--prompt is the text --sample continues: give --sample N too");
  if (o->sample <= 0)
    return 0;
  const char *prompt = o->prompt ? o->prompt : "\n";
  int32_t *seq = rt_alloc((strlen(prompt) + 1) * sizeof(int32_t), "the prompt");
  int64_t n = 0;
  int status = prompt_tokens(m, prompt, seq, &n);
  free(seq);
  return status;
}

// Generates opt.sample tokens after the prompt: each forward sees the last seqlen tokens in
// every window of the batch, and the next token is drawn from the logits of global window 0 at
// the last position (rt_sample_token; key rt_key(rt_key(seed, RT_STREAM_SAMPLE), i) for the
// i-th token), then shared by rank 0 (of the last pipeline stage, whose forward ends in the
// logits; the earlier stages' forwards pass the activations on). Collective.
int rt_sample(RtTrainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int64_t L = m->seqlen, n = tr->opt.sample, plen = 0;
  const char *prompt = tr->opt.prompt ? tr->opt.prompt : "\n";
  int32_t *seq = rt_alloc((strlen(prompt) + 1 + (size_t)n) * sizeof(int32_t), "the sample");
  int status = prompt_tokens(m, prompt, seq, &plen);
  if (rt_world_agree(tr->comm, status) != 0) {
    free(seq);
    return -1;
  }
  uint64_t key = rt_key(m->seed, RT_STREAM_SAMPLE);
  int stages = tr->ranks.stages;
  bool last = tr->ranks.stage == stages - 1;
  int32_t *in = (int32_t *)tr->input, *tgt = (int32_t *)tr->target;
  for (int64_t k = 0; k < n; k++) {
    int64_t len = plen + k, start = len > L ? len - L : 0, ctx = len - start;
    for (int64_t b = 0; b < m->batch; b++)
      for (int64_t i = 0; i < L; i++) {
        in[b * L + i] = i < ctx ? seq[start + i] : 0;
        tgt[b * L + i] = 0;
      }
    st->step = tr->done_steps + 1;
    if (stages > 1)
      rt_pipe_forward(tr);
    else
      m->forward(st);
    if (rt_device_get(tr, RT_DEVICE_OUTPUT) != 0) {
      free(seq);
      return -1;
    }
    // The logits are the last stage's (with stages): its rank 0 draws, and every rank of every
    // stage receives the token.
    const float *logits = last ? rt_lm_logits(tr) : NULL;
    if (rt_world_agree(tr->comm, last && !logits ? -1 : 0) != 0) {
      free(seq);
      return -1;
    }
    int32_t next = 0;
    if (last && tr->ranks.rank == 0)
      next = rt_sample_token(logits + (ctx - 1) * m->vocab, (int)m->vocab, (float)tr->opt.temperature,
                             rt_key(key, (uint64_t)k));
    if (stages > 1)
      rt_all_bcast(tr->comm, &next, sizeof next, (stages - 1) * tr->ranks.world);
    else if (tr->ranks.world > 1)
      rt_bcast(tr->comm, RT_GROUP_WORLD, &next, sizeof next, 0);
    seq[len] = next;
  }
  if (rt_is_root(tr)) {
    printf("# sample: %lld tokens after a %lld-token prompt, temperature %g\n", (long long)n, (long long)plen,
           tr->opt.temperature);
    rt_print_tokens(stdout, m, seq, plen + n);
    fflush(stdout);
  }
  free(seq);
  return 0;
}
