// Timelines of a simulated stream program: Chrome trace JSON (load it in Perfetto or
// chrome://tracing; one thread per stream, complete events with times in microseconds) and a
// self-contained SVG with one row per stream, like Fig. 3 of the paper: each op a box coloured
// by kind and labelled with its kind and chunk (D3 = dispatch of chunk 3, AR = AllReduce),
// backward ops drawn lighter, a line where the forward pass ends.
#include <math.h>
#include <string.h>

#include "sched.h"

static const char *const short_name[SCHED_NOPKINDS] = {
    [SCHED_OP_ATTENTION] = "Att", [SCHED_OP_DISPATCH] = "D", [SCHED_OP_ALLGATHER] = "G",
    [SCHED_OP_EXPERT] = "E", [SCHED_OP_REDUCESCATTER] = "S", [SCHED_OP_COMBINE] = "C",
    [SCHED_OP_ALLREDUCE] = "AR"};

static const char *const colour[SCHED_NOPKINDS] = {
    [SCHED_OP_ATTENTION] = "#8da0cb", [SCHED_OP_DISPATCH] = "#fc8d62", [SCHED_OP_ALLGATHER] = "#66c2a5",
    [SCHED_OP_EXPERT] = "#ffd92f", [SCHED_OP_REDUCESCATTER] = "#a6d854", [SCHED_OP_COMBINE] = "#e78ac3",
    [SCHED_OP_ALLREDUCE] = "#b3b3b3"};

// Writes s as the contents of a JSON or XML string (both escape the same few characters here).
static void put_escaped(FILE *out, const char *s, bool xml) {
  for (; s && *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (xml && ch == '<') fputs("&lt;", out);
    else if (xml && ch == '>') fputs("&gt;", out);
    else if (xml && ch == '&') fputs("&amp;", out);
    else if (xml && ch == '"') fputs("&quot;", out);
    else if (!xml && (ch == '"' || ch == '\\')) fprintf(out, "\\%c", ch);
    else if (ch < 0x20) fprintf(out, xml ? " " : "\\u%04x", ch);
    else fputc(ch, out);
  }
}

static void op_label(const SchedOp *o, char *buf, size_t n) {
  if (o->kind == SCHED_OP_ATTENTION || o->kind == SCHED_OP_ALLREDUCE) snprintf(buf, n, "%s", short_name[o->kind]);
  else snprintf(buf, n, "%s%d", short_name[o->kind], o->chunk + 1);
}

bool sched_write_trace(FILE *out, const SchedProgram *g, const char *title) {
  fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", out);
  fputs("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":\"", out);
  put_escaped(out, title, false);
  fputs("\"}}", out);
  for (int k = 0; k < g->nstreams; k++) {
    fprintf(out, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"name\":\"%s\"}}", k,
            g->stream_name[k]);
    fprintf(out, ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":0,\"tid\":%d,\"args\":{\"sort_index\":%d}}",
            k, k);
  }
  for (int i = 0; i < g->nops; i++) {
    const SchedOp *o = &g->op[i];
    char label[32];
    op_label(o, label, sizeof label);
    fprintf(out,
            ",\n{\"name\":\"%s L%d %s\",\"cat\":\"%s,%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":0,\"tid\":%d,"
            "\"args\":{\"op\":\"%s\",\"layer\":%d,\"phase\":\"%s\",\"chunk\":%d,\"elements\":%.0f,\"resource\":\"%s\"}}",
            label, o->layer, o->phase == SCHED_FWD ? "fwd" : "bwd", sched_op_name[o->kind],
            o->phase == SCHED_FWD ? "forward" : "backward", o->start * 1e3, o->dur * 1e3, o->stream,
            sched_op_name[o->kind], o->layer, o->phase == SCHED_FWD ? "forward" : "backward", o->chunk, o->elems,
            sched_resource_name[o->res]);
  }
  fputs("\n]}\n", out);
  return !ferror(out);
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving at most about `ticks` ticks.
static double tick_step(double span, int ticks) {
  double raw = span / ticks, p = pow(10, floor(log10(raw)));
  if (raw <= p) return p;
  if (raw <= 2 * p) return 2 * p;
  if (raw <= 5 * p) return 5 * p;
  return 10 * p;
}

bool sched_write_svg(FILE *out, const SchedProgram *g, const char *title) {
  const double left = 90, right = 20, top = 40, row_h = 34, box_h = 24, width = 1400;
  double span = g->makespan > 0 ? g->makespan : 1, plot_w = width - left - right;
  double height = top + row_h * g->nstreams + 70;
  fprintf(out,
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" "
          "font-family=\"sans-serif\" font-size=\"11\">\n",
          width, height, width, height);
  fputs("<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"14\">", out);
  put_escaped(out, title, true);
  fputs("</text>\n", out);
  for (int k = 0; k < g->nstreams; k++) {
    double y = top + row_h * k;
    fprintf(out, "<g class=\"stream\" data-stream=\"%s\">\n", g->stream_name[k]);
    fprintf(out, "<text x=\"10\" y=\"%.1f\">%s</text>\n", y + box_h * 0.7, g->stream_name[k]);
    fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", left, y + box_h + 4,
            width - right, y + box_h + 4);
    for (int i = 0; i < g->nops; i++) {
      const SchedOp *o = &g->op[i];
      if (o->stream != k || !(o->dur > 0)) continue;
      double x = left + o->start / span * plot_w, w = fmax(o->dur / span * plot_w, 0.5);
      char label[32];
      op_label(o, label, sizeof label);
      fprintf(out,
              "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" fill-opacity=\"%s\" "
              "stroke=\"#333\" stroke-width=\"0.4\"><title>%s layer %d %s chunk %d: %.3f-%.3f ms</title></rect>\n",
              x, y, w, box_h, colour[o->kind], o->phase == SCHED_FWD ? "1" : "0.6", sched_op_name[o->kind], o->layer,
              o->phase == SCHED_FWD ? "forward" : "backward", o->chunk + 1, o->start, o->end);
      if (w > 7.0 * (double)strlen(label))
        fprintf(out, "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n", x + w / 2, y + box_h * 0.68,
                label);
    }
    fputs("</g>\n", out);
  }
  double axis_y = top + row_h * g->nstreams + 6, step = tick_step(span, 10);
  fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", left, axis_y,
          width - right, axis_y);
  for (double t = 0; t <= span * (1 + 1e-9); t += step) {
    double x = left + t / span * plot_w;
    fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>", x, axis_y, x, axis_y + 4);
    fprintf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", x, axis_y + 16, t);
  }
  fprintf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">ms</text>\n", width - right, axis_y + 30);
  if (g->t_fwd > 0 && g->t_fwd < span) {
    double x = left + g->t_fwd / span * plot_w;
    fprintf(out,
            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"red\" stroke-dasharray=\"4 3\"/>"
            "<text x=\"%.1f\" y=\"%.1f\" fill=\"red\">backward</text>\n",
            x, top - 6, x, axis_y, x + 3, top - 8);
  }
  double lx = left, ly = axis_y + 40;
  for (int kind = 0; kind < SCHED_NOPKINDS; kind++) {
    fprintf(out, "<rect x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\" stroke=\"#333\" stroke-width=\"0.4\"/>"
                 "<text x=\"%.1f\" y=\"%.1f\">%s (%s)</text>\n",
            lx, ly, colour[kind], lx + 16, ly + 10, sched_op_name[kind], short_name[kind]);
    lx += 150;
  }
  fputs("</svg>\n", out);
  return !ferror(out);
}
