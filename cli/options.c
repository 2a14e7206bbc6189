// The option parser of the subcommands (cli/options.h): one table-driven walk over argv and the
// messages every command prints for a usage error.
#include "cli/options.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

bool cli_args_error(const CliArgs *a, const char *fmt, ...) {
  if (a->quiet) return false;
  va_list ap;
  va_start(ap, fmt);
  fputs(a->prefix ? a->prefix : "moec: error: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return false;
}

bool cli_opt_positive(const CliArgs *a, const char *opt, const char *value, void *dest) {
  char *end;
  double v = strtod(value, &end);
  if (*value == '\0' || *end != '\0' || !(v > 0) || !isfinite(v))
    return cli_args_error(a, "%s takes a positive number, not '%s'", opt, value);
  *(double *)dest = v;
  return true;
}

// The option of the table that arg names (*attached: the value after "NAME="), or NULL.
static const CliOpt *find(const CliArgs *a, const char *arg, const char **attached) {
  *attached = NULL;
  for (int i = 0; i < a->nopts; i++) {
    const CliOpt *o = &a->opts[i];
    size_t len = strlen(o->name);
    if (len > 0 && o->name[len - 1] == '=') {
      if (strncmp(arg, o->name, len) == 0) {
        *attached = arg + len;
        return o;
      }
    } else if (strcmp(arg, o->name) == 0 || (o->alias && strcmp(arg, o->alias) == 0)) {
      return o;
    }
  }
  return NULL;
}

// An argument no option names: the positional one, or an error (reported).
static bool other(const CliArgs *a, const char *arg) {
  bool option = arg[0] == '-' && (arg[1] || !a->positional || !a->dash_is_positional);
  if (!option && a->positional && !*a->positional) {
    *a->positional = arg;
    return true;
  }
  if (!option && a->positional) return cli_args_error(a, "%s ('%s' and '%s')", a->second, *a->positional, arg);
  const char *what = option ? "unknown option" : a->stray;
  if (!a->for_what) return cli_args_error(a, "%s '%s'", what, arg);
  return cli_args_error(a, "%s '%s' for %s (see '%s --help')", what, arg, a->for_what, a->help);
}

bool cli_parse_args(const CliArgs *a, int argc, char **argv) {
  for (int i = 2; i < argc; i++) {
    const char *arg = argv[i], *value;
    const CliOpt *o = find(a, arg, &value);
    if (!o) {
      if (!other(a, arg)) return false;
      continue;
    }
    if (o->flag) {
      *(bool *)o->dest = true;
      continue;
    }
    if (!value) {
      if (i + 1 >= argc) {
        if (!a->quiet) {
          fputs(a->prefix ? a->prefix : "moec: error: ", stderr);
          fprintf(stderr, a->needs_value ? a->needs_value : "option '%s' needs a value", arg);
          fputc('\n', stderr);
        }
        return false;
      }
      value = argv[++i];
    }
    if (!o->check) *(const char **)o->dest = value;
    else if (!o->check(a, arg, value, o->dest)) return false;
  }
  return true;
}
