// --dump DIR and --export-hf DIR: rank 0 writes whole tensors, gathered from every rank's shard
// and DP part (world.c), so that the files do not depend on the layout (main.c's opening
// comment). Both are collective: every rank takes part in every gather, even after rank 0
// failed to write, and then all agree on the outcome.
#include "rt_hf.h"
#include "rt_trainer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// ---- --dump ----


// A language model's part of the dump (lang/manual.md §7.2): tokens.npy (int32 [dp*B, L+1], each window),
// logits.npy [dp*B, L, V] and ce.npy. Collective; whole holds dp*B*L*V floats.
static int dump_lm(RtTrainer *tr, const RtReport *rep, float *whole, char *path, size_t len, int status) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  bool root = rt_is_root(tr);
  int64_t L = m->seqlen, tokens = m->batch * L, rows = r->dp * m->batch;
  int32_t *windows = root ? rt_alloc((size_t)(rows * (L + 1)) * sizeof(int32_t), "the --dump tokens") : NULL;
  rt_gather_dp(tr->comm, r, tr->input, tokens, whole);
  for (int64_t b = 0; root && b < rows; b++)
    memcpy(windows + b * (L + 1), (const int32_t *)whole + b * L, (size_t)L * sizeof(int32_t));
  rt_gather_dp(tr->comm, r, tr->target, tokens, whole);
  for (int64_t b = 0; root && b < rows; b++)
    windows[b * (L + 1) + L] = ((const int32_t *)whole)[b * L + L - 1];
  if (root && status == 0) {
    snprintf(path, len, "%s/tokens.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_I32, 2, (int64_t[]){rows, L + 1}, windows);
  }
  free(windows);
  const float *logits = rt_lm_logits(tr);
  if (!logits)
    return -1;
  rt_gather_dp(tr->comm, r, logits, tokens * m->vocab, whole);
  if (root && status == 0) {
    snprintf(path, len, "%s/logits.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_F32, 3, (int64_t[]){rows, L, m->vocab}, whole);
  }
  if (root && status == 0) {
    snprintf(path, len, "%s/ce.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &rep->mse);
  }
  return status;
}

// Rank 0 writes whole tensors: the global batch's input, target and output (gathered over DP)
// and every parameter's gradient assembled from the ranks' shards. Collective on several ranks:
// every rank takes part in every gather even after rank 0 failed to write, then all agree.
//
// With microbatches or pipeline stages the step's tensors are the loss and the gradients (the
// mean over the microbatches): each stage's rank 0 writes its parameters' (a tensor two stages
// hold, the first's), rank 0 of the first stage the loss; the data and outputs of the
// microbatches are not kept to the end of the step and are not written.
int rt_dump_step(RtTrainer *tr, const RtReport *rep) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  const char *dir = tr->opt.dump;
  bool whole_step = m->microbatches <= 1 && r->stages <= 1;
  bool root = r->rank == 0;   // of this stage (rt_is_root: of the first)
  if (rt_device_get(tr, RT_DEVICE_GRADS | RT_DEVICE_OUTPUT) != 0)
    return -1;
  int status = tr->st.output || !whole_step ? 0
                             : rt_fail("internal error: the forward of model '%s' did not set "
                                       "its output", m->name);
  if (rt_world_agree(tr->comm, status) != 0)
    return -1;
  size_t len = strlen(dir) + 512;
  char *path = NULL;
  int64_t tokens = m->batch * m->seqlen, logits = tokens * m->vocab;
  size_t whole_floats = (size_t)(r->dp * (tr->elems > logits ? tr->elems : logits));
  for (int i = 0; i < m->nparams; i++) {
    size_t n = (size_t)rt_param_global_numel(&m->params[i]);
    whole_floats = n > whole_floats ? n : whole_floats;
  }
  float *whole = NULL;
  if (root) {
    path = rt_alloc(len, "the names of the --dump files");
    whole = rt_alloc(whole_floats * sizeof(float), "a whole tensor of the --dump");
    snprintf(path, len, "%s/grad", dir);
    status = rt_make_dirs(path);
  }
  if (rt_world_agree(tr->comm, status) != 0) {
    free(path);
    free(whole);
    return -1;
  }
  if (!whole_step) {
    // the loss and the gradients only (above)
  } else if (m->vocab > 0) {
    status = dump_lm(tr, rep, whole, path, len, status);
  } else {
    int64_t dims[3] = {r->dp * m->batch, m->seqlen, m->embed};
    const char *names[3] = {"input", "target", "output"};
    const float *data[3] = {tr->st.input, tr->st.target, tr->st.output};
    for (int k = 0; k < 3; k++) {
      rt_gather_dp(tr->comm, r, data[k], tr->elems, whole);
      if (root && status == 0) {
        snprintf(path, len, "%s/%s.npy", dir, names[k]);
        status = rt_npy_write(path, RT_DTYPE_F32, 3, dims, whole);
      }
    }
  }
  if (root && r->stage == 0 && status == 0) {
    snprintf(path, len, "%s/loss.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &rep->loss);
  }
  rt_shard_gather_grads(tr->comm, m, tr->st.grads);   // (the update reads its own rows only)
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    if ((tr->pp_skip && tr->pp_skip[i]) || p->frozen)   // the earlier stage that holds it too writes it;
      continue;                                           // a frozen one has none
    rt_gather_param(tr->comm, p, r, tr->st.grads + p->offset, whole);
    if (root && status == 0) {
      snprintf(path, len, "%s/grad/%s.npy", dir, p->name);
      status = rt_npy_write(path, RT_DTYPE_F32, p->rank, p->global_dims, whole);
    }
  }
  free(path);
  free(whole);
  return rt_world_agree(tr->comm, status);
}

// ---- --export-hf ----

// With pipeline stages: the model of every stage's parameters (a tensor two stages hold once, the
// earlier's), each gathered whole on its stage's rank 0 and sent to the first stage's, which
// writes the checkpoint. Collective over the job.
static int dump_hf_stages(RtTrainer *tr, const char *dir) {
  const RtRanks *r = &tr->ranks;
  int total = 0, n = 0;
  for (int s = 0; s < r->stages; s++) total += tr->stages[s]->nparams;
  RtParam *all = rt_calloc((size_t)(total ? total : 1), sizeof *all, "the parameters of a checkpoint");
  int *owner = rt_calloc((size_t)(total ? total : 1), sizeof *owner, "the parameters of a checkpoint");
  int *index = rt_calloc((size_t)(total ? total : 1), sizeof *index, "the parameters of a checkpoint");
  for (int s = 0; s < r->stages; s++)
    for (int i = 0; i < tr->stages[s]->nparams; i++) {
      const RtParam *p = &tr->stages[s]->params[i];
      int k = 0;
      while (k < n && strcmp(all[k].name, p->name) != 0) k++;
      if (k < n) continue;
      all[n] = *p, owner[n] = s, index[n] = i;
      n++;
    }
  bool root = rt_is_root(tr);
  float **whole = root ? rt_calloc((size_t)(n ? n : 1), sizeof *whole, "the parameters of a checkpoint") : NULL;
  for (int k = 0; k < n; k++) {
    int64_t numel = rt_param_global_numel(&all[k]);
    if (r->stage == owner[k]) {
      const RtParam *p = &tr->model->params[index[k]];
      float *buf = r->rank == 0 ? rt_alloc((size_t)numel * sizeof(float), "a parameter of a checkpoint") : NULL;
      rt_gather_param(tr->comm, p, r, tr->st.params + p->offset, buf);
      if (buf && owner[k] == 0) {
        whole[k] = buf;
      } else if (buf) {
        RtPpSend send;
        rt_pp_send(tr->comm, 0, buf, numel, k, &send);
        rt_pp_wait(&send);
        free(buf);
      }
    } else if (root) {
      whole[k] = rt_alloc((size_t)numel * sizeof(float), "a parameter of a checkpoint");
      rt_pp_recv(tr->comm, owner[k], whole[k], numel, k);
    }
  }
  int status = 0;
  if (root) {
    RtModel m = *tr->stages[0];
    m.params = all, m.nparams = n;
    status = rt_hf_export(&m, whole, dir, tr->opt.merge);
    if (status == 0 && !tr->opt.quiet && m.hf_adapter && !tr->opt.merge)
      printf("# wrote %s/adapter_config.json and %s/adapter_model.safetensors (a PEFT LoRA adapter; the "
             "parameters of %d stages)\n", dir, dir, r->stages);
    else if (status == 0 && !tr->opt.quiet)
      printf("# wrote %s/config.json%s and %s/model.safetensors (Hugging Face; the parameters of %d stages)\n", dir,
             m.hf_generation ? ", generation_config.json" : "", dir, r->stages);
  }
  for (int k = 0; root && k < n; k++) free(whole[k]);
  free(whole), free(all), free(owner), free(index);
  return rt_world_agree(tr->comm, status);
}

// --export-hf DIR: every parameter gathered whole on rank 0, which writes the checkpoint.
// Collective.
int rt_dump_hf(RtTrainer *tr, const char *dir) {
  if (tr->ranks.stages > 1)
    return dump_hf_stages(tr, dir);
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  bool root = r->rank == 0;
  float **whole = root ? rt_calloc((size_t)m->nparams, sizeof *whole, "the parameters of a checkpoint") : NULL;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    if (root) whole[i] = rt_alloc((size_t)rt_param_global_numel(p) * sizeof(float), "a parameter of a checkpoint");
    rt_gather_param(tr->comm, p, r, tr->st.params + p->offset, root ? whole[i] : NULL);
  }
  int status = root ? rt_hf_export(m, whole, dir, tr->opt.merge) : 0;
  if (root && status == 0 && !tr->opt.quiet && m->hf_adapter && !tr->opt.merge) {
    printf("# wrote %s/adapter_config.json and %s/adapter_model.safetensors (a PEFT LoRA adapter)\n", dir, dir);
  } else if (root && status == 0 && !tr->opt.quiet) {
    printf("# wrote %s/config.json%s and %s/model.safetensors (Hugging Face)\n", dir,
           m->hf_generation ? ", generation_config.json" : "", dir);
    if (m->hf_changes)   // the imported config's values this model replaced
      printf("# config.json: the model's own values for: %s\n", m->hf_changes);
  }
  for (int i = 0; root && i < m->nparams; i++) free(whole[i]);
  free(whole);
  return rt_world_agree(tr->comm, status);
}
