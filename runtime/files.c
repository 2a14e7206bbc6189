// File helpers below the runtime's writers (--dump in dump.c, --export-hf in hf.c): a folder
// made with the ones above it. Errors are rt_fail's sentences (error.c).
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "moert.h"
#include "rt_internal.h"

// The folder path and the ones above it that are missing (mkdir -p).
int rt_make_dirs(const char *path) {
  char *p = rt_strdup(path, "a folder's name");
  int status = 0;
  for (char *s = p + 1;; s++) {
    if (*s != '/' && *s != '\0')
      continue;
    char saved = *s;
    *s = '\0';
    struct stat sb;
    if (mkdir(p, 0777) != 0 && errno != EEXIST) {
      status = rt_fail("cannot create directory '%s': %s", p, strerror(errno));
      break;
    }
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
      status = rt_fail("cannot create directory '%s': a file of that name is in the way", p);
      break;
    }
    *s = saved;
    if (saved == '\0')
      break;
  }
  free(p);
  return status;
}
