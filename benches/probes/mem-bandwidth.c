// Read bandwidth from memory with one and two threads (512 MB, 512-bit loads, best of five): what a one-token step,
// which streams every weight once, could reach at most. A probe of the machine, not of the engine.
//
//   gcc -O2 -fopenmp -mavx512f benches/probes/mem-bandwidth.c -o /tmp/mem-bandwidth && /tmp/mem-bandwidth
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){ size_t n=512UL<<20; char*b=aligned_alloc(64,n); for(size_t i=0;i<n;i+=4096)b[i]=1; for(size_t i=0;i<n;i++)b[i]=i;
 for(int th=1;th<=2;th++){ double best=1e9; for(int rep=0;rep<5;rep++){ double t=now();
 #pragma omp parallel num_threads(th)
 { int id=omp_get_thread_num(); size_t per=n/th; const char*p=b+id*per; __m512i a0=_mm512_setzero_si512(),a1=a0,a2=a0,a3=a0;
   for(size_t i=0;i<per;i+=256){ a0=_mm512_add_epi32(a0,_mm512_load_si512(p+i)); a1=_mm512_add_epi32(a1,_mm512_load_si512(p+i+64)); a2=_mm512_add_epi32(a2,_mm512_load_si512(p+i+128)); a3=_mm512_add_epi32(a3,_mm512_load_si512(p+i+192)); }
   __m512i s=_mm512_add_epi32(_mm512_add_epi32(a0,a1),_mm512_add_epi32(a2,a3)); if(_mm512_reduce_add_epi32(s)==7)puts("y"); }
 t=now()-t; if(t<best)best=t; }
 printf("%d threads: %.1f GB/s\n",th,n/best/1e9);} }
