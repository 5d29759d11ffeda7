/*
 * braid's JPEG shim: the few calls braid-data makes into libjpeg-turbo's
 * libjpeg API (src/jpeg.rs is the safe Rust side).
 *
 * Every function returns 0 on success and -1 on failure, with a message
 * (libjpeg's own, or the shim's) in the caller's `err` buffer, always
 * NUL-terminated. libjpeg reports errors by calling error_exit, which by
 * default prints and calls exit(); here it copies the message and
 * longjmp()s back to the shim function that called setjmp. Warnings
 * (corrupt or truncated data, which libjpeg would otherwise paper over
 * with grey pixels) are errors too. Nothing is ever printed.
 *
 * setjmp/longjmp stay inside C: every setjmp is in a shim function whose
 * caller is Rust, and every longjmp comes from libjpeg code called by that
 * function, so no Rust frame is ever jumped over. The state that must
 * survive a longjmp lives in a struct owned by the caller of the function
 * that calls setjmp (never in that function's own locals, whose values C
 * leaves indeterminate after a longjmp).
 *
 * Each call has its own libjpeg objects, so the functions may be called
 * from many threads at once.
 */

#include <limits.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h> /* jpeglib.h needs FILE */
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

/* ---------------------------------------------------------------------- */
/* Errors                                                                 */

struct braid_err {
  struct jpeg_error_mgr pub; /* first: libjpeg casts cinfo->err to this */
  jmp_buf jump;
  char *msg;
  size_t msglen;
};

/* Copies `text` into the caller's buffer, truncated, NUL-terminated. */
static void put_msg(char *msg, size_t msglen, const char *text) {
  size_t n;
  if (msg == NULL || msglen == 0)
    return;
  n = strlen(text);
  if (n >= msglen)
    n = msglen - 1;
  memcpy(msg, text, n);
  msg[n] = '\0';
}

static void braid_error_exit(j_common_ptr cinfo) {
  struct braid_err *e = (struct braid_err *)cinfo->err;
  char text[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, text);
  put_msg(e->msg, e->msglen, text);
  longjmp(e->jump, 1);
}

/* msg_level -1 is a warning (corrupt data, premature end of file): fail.
 * Levels 0 and up are trace messages: ignore them. */
static void braid_emit_message(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0) {
    cinfo->err->num_warnings++;
    braid_error_exit(cinfo);
  }
}

static void braid_output_message(j_common_ptr cinfo) { (void)cinfo; }

static void init_err(struct braid_err *e, char *msg, size_t msglen) {
  jpeg_std_error(&e->pub);
  e->pub.error_exit = braid_error_exit;
  e->pub.emit_message = braid_emit_message;
  e->pub.output_message = braid_output_message;
  e->msg = msg;
  e->msglen = msglen;
  put_msg(msg, msglen, "");
}

/* ---------------------------------------------------------------------- */
/* Header                                                                 */

struct info_job {
  struct jpeg_decompress_struct cinfo;
  struct braid_err err;
  const unsigned char *buf;
  size_t len;
  unsigned *width, *height, *components;
};

static int info_run(struct info_job *job) {
  if (setjmp(job->err.jump)) {
    jpeg_destroy_decompress(&job->cinfo);
    return -1;
  }
  jpeg_create_decompress(&job->cinfo);
  jpeg_mem_src(&job->cinfo, job->buf, (unsigned long)job->len);
  jpeg_read_header(&job->cinfo, TRUE);
  *job->width = job->cinfo.image_width;
  *job->height = job->cinfo.image_height;
  *job->components = (unsigned)job->cinfo.num_components;
  jpeg_destroy_decompress(&job->cinfo);
  return 0;
}

int braid_jpeg_info(const unsigned char *buf, size_t len, unsigned *width,
                    unsigned *height, unsigned *components, char *err,
                    size_t errlen) {
  struct info_job job;
  memset(&job, 0, sizeof job);
  init_err(&job.err, err, errlen);
  if (len > ULONG_MAX) {
    put_msg(err, errlen, "JPEG payload larger than libjpeg can take");
    return -1;
  }
  job.cinfo.err = &job.err.pub;
  job.buf = buf;
  job.len = len;
  job.width = width;
  job.height = height;
  job.components = components;
  return info_run(&job);
}

/* ---------------------------------------------------------------------- */
/* Decoding, scaled, cropped                                              */

struct decode_job {
  struct jpeg_decompress_struct cinfo;
  struct braid_err err;
  const unsigned char *buf;
  size_t len;
  unsigned scale_denom, crop_x, crop_y, crop_w, crop_h;
  unsigned char *out;
  size_t out_capacity;
  /* Wide mode: rows are written as libjpeg decodes them (the window
   * widened to its iMCU columns, `row_w` pixels from column `row_x` of
   * the scaled image), with no copy; `crop_x - row_x` is where the asked
   * window starts in each row. */
  int wide;
  unsigned row_x, row_w;
};

static int decode_fail(struct decode_job *job, const char *text) {
  put_msg(job->err.msg, job->err.msglen, text);
  jpeg_destroy_decompress(&job->cinfo);
  return -1;
}

static int decode_run(struct decode_job *job) {
  struct jpeg_decompress_struct *cinfo = &job->cinfo;
  char text[256];
  JDIMENSION out_w, out_h, x0, x1, xoff, cw, row;
  JSAMPARRAY line;
  size_t stride, skip_bytes;

  if (setjmp(job->err.jump)) {
    jpeg_destroy_decompress(cinfo);
    return -1;
  }
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, job->buf, (unsigned long)job->len);
  jpeg_read_header(cinfo, TRUE);
  if (cinfo->jpeg_color_space == JCS_CMYK ||
      cinfo->jpeg_color_space == JCS_YCCK)
    return decode_fail(job, "CMYK/YCCK JPEG: braid decodes only grayscale "
                            "and YCbCr/RGB JPEGs; convert the image to RGB");
  cinfo->out_color_space = JCS_RGB;
  cinfo->dct_method = JDCT_IFAST;
  cinfo->do_fancy_upsampling = TRUE;
  cinfo->scale_num = 1;
  cinfo->scale_denom = job->scale_denom;
  jpeg_calc_output_dimensions(cinfo);
  out_w = cinfo->output_width;
  out_h = cinfo->output_height;
  if (job->crop_w == 0 || job->crop_h == 0 ||
      (uint64_t)job->crop_x + job->crop_w > out_w ||
      (uint64_t)job->crop_y + job->crop_h > out_h) {
    snprintf(text, sizeof text,
             "crop %ux%u at (%u, %u) does not lie inside the %ux%u image "
             "(%ux%u scaled by 1/%u)",
             job->crop_w, job->crop_h, job->crop_x, job->crop_y, out_w, out_h,
             cinfo->image_width, cinfo->image_height, job->scale_denom);
    return decode_fail(job, text);
  }
  /* (Wide mode: rows may be as wide as the scaled image.) */
  stride = (size_t)(job->wide ? out_w : job->crop_w) * 3;
  if ((uint64_t)job->crop_h * stride > job->out_capacity) {
    snprintf(text, sizeof text,
             "output buffer holds %zu bytes; a %ux%u RGB crop needs %llu",
             job->out_capacity, job->crop_w, job->crop_h,
             (unsigned long long)((uint64_t)job->crop_h * stride));
    return decode_fail(job, text);
  }

  jpeg_start_decompress(cinfo);

  /* Columns: decode one pixel more on each side than asked for, so that
   * the fancy (triangle-filter) chroma upsampling of the first and last
   * columns sees the same neighbours as in a full decode: the pixels then
   * equal the full decode's bit for bit. And at least 8 pixels: below 2
   * chroma samples across, libjpeg would switch to plain (box)
   * upsampling. jpeg_crop_scanline widens the window further, to the
   * iMCU boundary on its left. */
  x0 = job->crop_x > 0 ? job->crop_x - 1 : 0;
  x1 = job->crop_x + job->crop_w < out_w ? job->crop_x + job->crop_w + 1
                                         : out_w;
  if (x1 - x0 < 8) {
    x1 = x0 + 8 < out_w ? x0 + 8 : out_w;
    x0 = x1 > 8 ? x1 - 8 : 0;
  }
  xoff = x0;
  cw = x1 - x0;
  if (xoff != 0 || cw != out_w)
    jpeg_crop_scanline(cinfo, &xoff, &cw);
  skip_bytes = (size_t)(job->crop_x - xoff) * 3;

  if (job->crop_y > 0 &&
      jpeg_skip_scanlines(cinfo, job->crop_y) != job->crop_y)
    return decode_fail(job, "JPEG data ended before the crop's first row");

  /* Full-width windows, and every window in wide mode, are read straight
   * into `out`; others through one row of libjpeg's (freed with the
   * decompress object). */
  line = NULL;
  if (job->wide) {
    stride = (size_t)cw * 3;
    job->row_x = xoff;
    job->row_w = cw;
  } else if (cw != job->crop_w)
    line = (*cinfo->mem->alloc_sarray)((j_common_ptr)cinfo, JPOOL_IMAGE,
                                       cw * 3, 1);
  for (row = 0; row < job->crop_h; row++) {
    unsigned char *dst = job->out + (size_t)row * stride;
    JSAMPROW rows[1];
    rows[0] = line != NULL ? line[0] : dst;
    if (jpeg_read_scanlines(cinfo, rows, 1) != 1)
      return decode_fail(job, "JPEG data ended before the crop's last row");
    if (line != NULL)
      memcpy(dst, line[0] + skip_bytes, stride);
  }

  /* Reading the last row: finish, which checks the rest of the file up to
   * its end marker. Otherwise stop here and decode nothing more. */
  if (cinfo->output_scanline == out_h)
    jpeg_finish_decompress(cinfo);
  else
    jpeg_abort_decompress(cinfo);
  jpeg_destroy_decompress(cinfo);
  return 0;
}

/* Decodes the crop_w x crop_h window at (crop_x, crop_y) of the image
 * scaled by 1/scale_denom into `out`: rows crop_w pixels wide, or (wide)
 * rows as libjpeg decodes them, *row_w pixels from column *row_x. */
int braid_jpeg_decode(const unsigned char *buf, size_t len,
                      unsigned scale_denom, unsigned crop_x, unsigned crop_y,
                      unsigned crop_w, unsigned crop_h, unsigned char *out,
                      size_t out_capacity, int wide, unsigned *row_x,
                      unsigned *row_w, char *err, size_t errlen) {
  struct decode_job job;
  int rc;
  char text[128];
  memset(&job, 0, sizeof job);
  init_err(&job.err, err, errlen);
  if (scale_denom != 1 && scale_denom != 2 && scale_denom != 4 &&
      scale_denom != 8) {
    snprintf(text, sizeof text,
             "JPEG scale 1/%u asked for; it must be 1/1, 1/2, 1/4 or 1/8",
             scale_denom);
    put_msg(err, errlen, text);
    return -1;
  }
  if (len > ULONG_MAX) {
    put_msg(err, errlen, "JPEG payload larger than libjpeg can take");
    return -1;
  }
  job.cinfo.err = &job.err.pub;
  job.buf = buf;
  job.len = len;
  job.scale_denom = scale_denom;
  job.crop_x = crop_x;
  job.crop_y = crop_y;
  job.crop_w = crop_w;
  job.crop_h = crop_h;
  job.out = out;
  job.out_capacity = out_capacity;
  job.wide = wide;
  job.row_x = crop_x;
  job.row_w = crop_w;
  rc = decode_run(&job);
  *row_x = job.row_x;
  *row_w = job.row_w;
  return rc;
}

/* ---------------------------------------------------------------------- */
/* Encoding                                                               */

/* A growing malloc'd destination. (libjpeg's jpeg_mem_dest keeps the
 * buffer it grows to in a private field until jpeg_finish_compress, so
 * after an error it could not be freed; this one is the job's, and the
 * job frees it on every error.) */
struct grow_dest {
  struct jpeg_destination_mgr pub; /* first: libjpeg casts cinfo->dest */
  unsigned char *buf;
  size_t cap;
};

static void grow_init(j_compress_ptr cinfo) {
  struct grow_dest *d = (struct grow_dest *)cinfo->dest;
  d->pub.next_output_byte = d->buf;
  d->pub.free_in_buffer = d->cap;
}

/* Called when the buffer is full: double it. */
static boolean grow_empty(j_compress_ptr cinfo) {
  struct grow_dest *d = (struct grow_dest *)cinfo->dest;
  size_t cap = d->cap * 2;
  unsigned char *buf = realloc(d->buf, cap);
  if (buf == NULL) {
    struct braid_err *e = (struct braid_err *)cinfo->err;
    put_msg(e->msg, e->msglen, "out of memory growing the JPEG output buffer");
    longjmp(e->jump, 1);
  }
  d->pub.next_output_byte = buf + d->cap;
  d->pub.free_in_buffer = cap - d->cap;
  d->buf = buf;
  d->cap = cap;
  return TRUE;
}

static void grow_term(j_compress_ptr cinfo) { (void)cinfo; }

struct encode_job {
  struct jpeg_compress_struct cinfo;
  struct braid_err err;
  struct grow_dest dest;
  const unsigned char *rgb;
  unsigned width, height;
  int quality;
};

static int encode_run(struct encode_job *job) {
  struct jpeg_compress_struct *cinfo = &job->cinfo;
  size_t stride = (size_t)job->width * 3;

  if (setjmp(job->err.jump)) {
    jpeg_destroy_compress(cinfo);
    free(job->dest.buf);
    job->dest.buf = NULL;
    return -1;
  }
  jpeg_create_compress(cinfo);
  cinfo->dest = &job->dest.pub;
  cinfo->image_width = job->width;
  cinfo->image_height = job->height;
  cinfo->input_components = 3;
  cinfo->in_color_space = JCS_RGB;
  /* As OpenCV's cv2.imencode('.jpg', ..., [IMWRITE_JPEG_QUALITY, q]):
   * defaults (4:2:0, Huffman tables of the standard, no optimisation, not
   * progressive), then the quality, limited to baseline tables. */
  jpeg_set_defaults(cinfo);
  jpeg_set_quality(cinfo, job->quality, TRUE);
  jpeg_start_compress(cinfo, TRUE);
  while (cinfo->next_scanline < cinfo->image_height) {
    JSAMPROW rows[1];
    rows[0] = (JSAMPROW)(job->rgb + (size_t)cinfo->next_scanline * stride);
    jpeg_write_scanlines(cinfo, rows, 1);
  }
  jpeg_finish_compress(cinfo);
  jpeg_destroy_compress(cinfo);
  return 0;
}

int braid_jpeg_encode(const unsigned char *rgb, unsigned width,
                      unsigned height, int quality, unsigned char **out,
                      size_t *outlen, char *err, size_t errlen) {
  struct encode_job job;
  size_t cap;
  memset(&job, 0, sizeof job);
  init_err(&job.err, err, errlen);
  *out = NULL;
  *outlen = 0;
  /* A first guess of a quarter of the raw size; it doubles as needed. */
  cap = (size_t)width * height * 3 / 4 + 4096;
  job.dest.buf = malloc(cap);
  if (job.dest.buf == NULL) {
    put_msg(err, errlen, "out of memory for the JPEG output buffer");
    return -1;
  }
  job.dest.cap = cap;
  job.dest.pub.init_destination = grow_init;
  job.dest.pub.empty_output_buffer = grow_empty;
  job.dest.pub.term_destination = grow_term;
  job.cinfo.err = &job.err.pub;
  job.rgb = rgb;
  job.width = width;
  job.height = height;
  job.quality = quality;
  if (encode_run(&job) != 0)
    return -1;
  *out = job.dest.buf;
  *outlen = job.dest.cap - job.dest.pub.free_in_buffer;
  return 0;
}

void braid_jpeg_free(unsigned char *ptr) { free(ptr); }
